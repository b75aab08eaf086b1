"""vLLM integration: hidden-state extraction through a vLLM engine and serving drafters with vLLM.

vLLM runs in its own virtual environment (found by ``utils/environment.vllm_python``), always as a subprocess; only
``connector`` is imported by vLLM itself, and nothing else here imports vLLM.
"""
