"""``prepare --engine auto``: the regeneration engine chosen by measured tokens/s and vLLM's server start against
the data budget. Timings are injected (a fake clock, a fake server), so the decision is tested on any machine."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch

from specdraft.data import regenerate as regen
from specdraft.data.regenerate import EngineRequest, GenerationSettings, resolve_engine
from specdraft.errors import SpecdraftError
from specdraft.integrations.vllm import engine as vllm_engine
from specdraft.integrations.vllm import generate as _vllm_generate  # noqa: F401  (registers the vllm engine)
from specdraft.tuning.engines import choose_engine, generation_rate

#: What benchmarks/regenerate_throughput.py measured on a busy 2-core CPU (README): HF 8, vLLM 48 tokens/s, 97 s start.
SLOW_CPU = {"hf_tokens_per_s": 8.0, "vllm_tokens_per_s": 48.0, "vllm_start_s": 97.0}


@pytest.mark.parametrize(
    "work, budget, running, expected",
    [
        (512 * 128, 300.0, False, "vllm"),  # the quickstart's 5 minutes: 9,744 tokens with vLLM vs 2,400 with HF
        (512 * 128, 60.0, False, "hf"),  # a minute: the server would still be starting when the budget ends
        (512 * 128, 60.0, True, "vllm"),  # ... unless the probe already started it
        (64, None, False, "hf"),  # no limit but little work: 8 s with HF vs 98 s with vLLM
        (512 * 128, None, False, "vllm"),  # no limit, much work: 2.3 h vs 24 min
        (1000, 100.0, False, "hf"),  # HF finishes all of it within the budget, vLLM would not
    ],
)
def test_the_engine_that_regenerates_more_within_the_budget_wins(work, budget, running, expected):
    engine, plan = choose_engine(SLOW_CPU, work_tokens=work, budget_s=budget, server_running=running)
    assert engine == expected
    assert plan["vllm"]["start_s"] == (0.0 if running else 97.0) and plan["hf"]["start_s"] == 0.0


def test_a_near_tie_keeps_hf():
    figures = {"hf_tokens_per_s": 10.0, "vllm_tokens_per_s": 10.5, "vllm_start_s": 0.0}
    assert choose_engine(figures, work_tokens=10_000, budget_s=None, server_running=True)[0] == "hf"


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class FakeServer:
    def __init__(self):
        self.stopped = 0

    def stop(self):
        self.stopped += 1


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A clock that only the fakes advance: HF generates ``hf`` tokens/s after a prefill of ``hf_prefill`` s, the
    server starts in ``start`` s and generates ``vllm`` tokens/s after ``vllm_prefill`` s; records the servers started."""
    clock = SimpleNamespace(
        now=1000.0,
        started=[],
        hf=8.0,
        vllm=48.0,
        start=97.0,
        hf_prefill=0.0,
        vllm_prefill=0.0,
        fail=None,
        fail_probe=None,
        vllm_cached=set(),
    )
    monkeypatch.setattr(regen, "time", SimpleNamespace(perf_counter=lambda: clock.now, monotonic=lambda: clock.now))
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))

    def hf_generate(request, prompts, tokens):
        clock.now += clock.hf_prefill + len(prompts) * tokens / clock.hf
        return [[1] * tokens for _ in prompts]

    def start_server(request, batches, *, startup_timeout):
        if clock.fail:
            raise SpecdraftError(clock.fail)
        clock.now += clock.start
        clock.started.append(FakeServer())
        return clock.started[-1]

    def probe_batch(server, request, prompts):
        if clock.fail_probe:
            raise SpecdraftError(clock.fail_probe)
        cached = tuple(map(tuple, prompts)) in clock.vllm_cached  # vLLM's prefix cache: a repeated prompt skips its prefill
        clock.vllm_cached.add(tuple(map(tuple, prompts)))
        clock.now += (0.0 if cached else clock.vllm_prefill) + len(prompts) * request.settings.max_new_tokens / clock.vllm
        return [[1] * request.settings.max_new_tokens for _ in prompts]

    monkeypatch.setattr(regen, "_hf_generate", hf_generate)
    fake = regen.ServerEngine(
        locate=lambda explicit=None: tmp_path / ".venv-vllm/bin/python",
        version=vllm_engine.vllm_version,
        start=start_server,
        probe=probe_batch,
    )
    monkeypatch.setitem(regen.SERVER_ENGINES._items, "vllm", fake)
    return clock


def _request(**settings):
    target = SimpleNamespace(fingerprint="f" * 16, model=torch.nn.Linear(1, 1))
    return EngineRequest(
        target,
        0,
        frozenset({2}),
        GenerationSettings(**{"max_new_tokens": 128, "temperature": 0.0, "batch_size": 16, "seed": 0, **settings}),
        forward_path="eager",
    )


PROMPTS = [[5] * (10 + i) for i in range(512)]


def test_auto_measures_once_keeps_the_started_server_and_decides_per_budget(fake_vllm):
    choice = resolve_engine(_request(), PROMPTS, requested="auto", threads=1, deadline=fake_vllm.now + 300)
    assert choice.engine == "vllm" and choice.server is fake_vllm.started[0] and not choice.server.stopped  # reused, not restarted
    assert choice.facts["engine_source"] == "measured" and choice.facts["threads_source"] == "flag"
    assert {k: choice.facts["engine_figures"][k] for k in SLOW_CPU} == pytest.approx(SLOW_CPU)
    assert choice.facts["engine_plan"]["vllm"]["start_s"] == 0.0  # already paid
    stored = json.loads(next(_cached()).read_text())
    assert stored["seconds"] == pytest.approx(
        {"hf_first_s": 2.0, "hf_step_s": 2.0, "vllm_first_s": 16 / 48, "vllm_step_s": 16 / 48, "vllm_start_s": 97.0}
    )
    assert stored["context"]["rows"] == 16

    # Cached: nothing is timed or started again; with one minute left the start cannot pay off, so HF.
    short = resolve_engine(_request(), PROMPTS, requested="auto", threads=1, deadline=fake_vllm.now + 60)
    assert short.engine == "hf" and short.server is None and len(fake_vllm.started) == 1 and short.facts["engine_source"] == "cached"
    assert resolve_engine(_request(), PROMPTS, requested="auto", threads=1, deadline=fake_vllm.now + 300).engine == "vllm"


def _cached():
    from specdraft.targets.identity import cache_root

    return (cache_root() / "measured").glob("regen-engine-*.json")


def test_rates_are_predicted_at_the_answer_length_not_read_off_a_prefill_bound_probe(fake_vllm):
    """Each engine generates 1 and PROBE_TOKENS tokens per prompt: the prefill and the step are told apart and the rate
    is the one of ``--max-new-tokens``-token replies. Here HF's prefill is slow, so a 16-token probe alone (16 * 16 tokens
    in 6 + 32 s: 6.7 tokens/s) would understate it; and the vLLM server caches prefixes, so its second generate of the
    probe prompts skips their prefill, which must not be read as fast steps."""
    fake_vllm.hf_prefill, fake_vllm.vllm_prefill = 6.0, 1.0
    for max_new_tokens in (128, 512):
        figures = resolve_engine(_request(max_new_tokens=max_new_tokens), PROMPTS, requested="auto", threads=1, deadline=None).facts[
            "engine_figures"
        ]
        steps = max_new_tokens - 1
        assert figures["hf_first_s"] == pytest.approx(6.0 + 16 / 8) and figures["hf_step_s"] == pytest.approx(16 / 8)
        assert figures["hf_tokens_per_s"] == pytest.approx(16 * max_new_tokens / (8.0 + 2.0 * steps))  # the fake's own rate
        assert figures["vllm_tokens_per_s"] == pytest.approx(16 * max_new_tokens / (1.0 + 16 / 48 * max_new_tokens))
    assert generation_rate(6.0, 0.0, rows=4, tokens=3) == pytest.approx(2.0)  # all of it prefill


def test_hf_wins_where_vllm_is_slow_here_and_its_server_is_stopped(fake_vllm):
    fake_vllm.vllm = 6.0  # e.g. a vLLM-CPU build without the kernels this CPU needs
    choice = resolve_engine(_request(), PROMPTS, requested="auto", threads=1, deadline=None)
    assert choice.engine == "hf" and choice.server is None and fake_vllm.started[0].stopped == 1


def test_no_vllm_environment_or_a_failed_start_means_hf_and_nothing_cached(fake_vllm, monkeypatch):
    fake_vllm.fail = "vLLM server exited with code 1 while starting"
    failed = resolve_engine(_request(), PROMPTS, requested="auto", threads=1, deadline=None)
    assert failed.engine == "hf" and "exited with code 1" in failed.facts["engine_source"]
    assert not list(_cached())
    fake_vllm.fail, fake_vllm.fail_probe = None, "the vLLM server answered HTTP 500"
    assert resolve_engine(_request(), PROMPTS, requested="auto", threads=1, deadline=None).engine == "hf"
    assert fake_vllm.started[0].stopped == 1 and not list(_cached())  # the server the failed probe started is stopped

    def missing(explicit=None):
        raise SpecdraftError("no vLLM environment")

    monkeypatch.setitem(regen.SERVER_ENGINES._items, "vllm", dataclasses.replace(regen.SERVER_ENGINES.get("vllm"), locate=missing))
    assert (
        resolve_engine(_request(), PROMPTS, requested="auto", threads=1, deadline=None)
        .facts["engine_source"]
        .startswith("no vLLM environment found")
    )
    with pytest.raises(SpecdraftError, match="no vLLM environment"):  # an explicit --vllm-python that does not exist is an error
        resolve_engine(dataclasses.replace(_request(), vllm_python="/nope/python"), PROMPTS, requested="auto", threads=1, deadline=None)


def test_an_explicit_engine_is_not_measured(fake_vllm):
    for engine in ("hf", "vllm"):
        choice = resolve_engine(_request(), PROMPTS, requested=engine, threads=1, deadline=None)
        assert (choice.engine, choice.server, choice.facts["engine_source"]) == (engine, None, "flag")
    assert fake_vllm.started == [] and fake_vllm.now == 1000.0


def test_prepare_auto_regenerates_on_the_probes_server_and_stops_it(tmp_path, tiny_llama_dir, fake_vllm, monkeypatch):
    """The probe's server generates the data (no second start) and is stopped when prepare ends."""
    from test_data_prepare import _conversations, _prepare

    used = []

    @contextlib.contextmanager
    def fake_batches(request, batches):
        used.append(request.server)
        yield ((index, [[7, 2] for _ in prompts]) for index, prompts in batches)

    monkeypatch.setitem(regen.REGENERATION_ENGINES._items, "vllm", fake_batches)
    summary, _ = _prepare(
        tmp_path, tiny_llama_dir, _conversations(40), regenerate=True, max_new_tokens=200, batch_size=4, engine="auto", threads=1
    )
    assert summary["engine"] == "vllm" and summary["engine_source"] == "measured" and summary["regenerated"] == 40
    assert used == fake_vllm.started and len(fake_vllm.started) == 1 and fake_vllm.started[0].stopped == 1


def test_hf_generates_on_the_path_measured_fastest_and_prepare_puts_the_target_back(tmp_path, tiny_llama_dir, fake_vllm, monkeypatch):
    """``--forward-path auto`` for HF regeneration: a short generate of the probe prompts timed on each path that
    applies (rates injected: prepacked twice eager's), the fastest kept for the batches and cached; prepare leaves the
    target on the path it found, for the stages after it to choose their own."""
    from specdraft.targets import load_target
    from specdraft.tuning import forward_path as fp
    from specdraft.tuning import streamed
    from test_data_prepare import _conversations, _prepare

    monkeypatch.setattr(streamed, "streamed_ops", lambda: None)  # candidates: eager, prepacked (no grouped heads: no gqa)
    rates = {"eager": 8.0, "prepacked": 16.0}
    timed = []

    def hf_generate(request, prompts, tokens):  # the probe times decoding steps of the probe prompts' tails, not their prefill
        assert max(map(len, prompts)) <= regen.STEP_PROBE_PROMPT_TOKENS and tokens == regen.STEP_PROBE_TOKENS
        timed.append(fp.current_path(request.target.model))
        fake_vllm.now += len(prompts) * tokens / rates[timed[-1]]
        return [[1] * tokens for _ in prompts]

    monkeypatch.setattr(regen, "_hf_generate", hf_generate)
    torch.set_num_threads(1)  # what --threads 1 leaves it at: the machine identity that keys the cache counts threads
    target = load_target(str(tiny_llama_dir))
    request = dataclasses.replace(_request(), target=SimpleNamespace(fingerprint="f" * 16, model=target.model), forward_path="auto")
    choice = resolve_engine(request, PROMPTS, requested="hf", threads=1, deadline=None)
    assert (choice.facts["forward_path"], choice.facts["forward_path_source"]) == ("prepacked", "measured")
    assert timed == ["eager", "eager", "prepacked"] and fp.current_path(target.model) == "prepacked"  # one untimed warm-up
    fp.use_path(target.model, "eager")
    again = resolve_engine(request, PROMPTS, requested="hf", threads=1, deadline=None)
    assert (again.facts["forward_path"], again.facts["forward_path_source"], len(timed)) == ("prepacked", "cached", 3)
    fp.use_path(target.model, "prepacked")
    flagged = resolve_engine(dataclasses.replace(request, forward_path="eager"), PROMPTS, requested="hf", threads=1, deadline=None)
    assert flagged.facts["forward_path_source"] == "flag" and fp.current_path(target.model) == "eager"

    seen = []

    @contextlib.contextmanager
    def fake_hf(request, batches):
        seen.append(fp.current_path(request.target.model))
        yield ((index, [[7, 2] for _ in prompts]) for index, prompts in batches)

    monkeypatch.setitem(regen.REGENERATION_ENGINES._items, "hf", fake_hf)
    monkeypatch.setattr("specdraft.targets.load_target", lambda *args, **kwargs: target)
    fp.use_path(target.model, "eager")
    summary, _ = _prepare(tmp_path, tiny_llama_dir, _conversations(8), regenerate=True, max_new_tokens=20, batch_size=4, threads=1)
    assert seen == ["prepacked"] and summary["forward_path"] == "prepacked" and summary["regenerated"] == 8
    assert fp.current_path(target.model) == "eager"


def test_auto_threads_time_the_paths_at_the_default_count_so_a_later_prepare_reuses_them(tiny_llama_dir, fake_vllm, monkeypatch):
    """With ``--threads auto`` the path probe runs at the default count, not at the count an earlier stage of the same
    process left behind (e.g. the previous prepare's thread probe): a cache keyed by that count made every later
    prepare in a process time all paths again."""
    from specdraft.targets import load_target
    from specdraft.tuning import streamed
    from specdraft.tuning.measured import available_cores

    monkeypatch.setattr(streamed, "streamed_ops", lambda: None)

    def hf_generate(request, prompts, tokens):
        fake_vllm.now += 1.0
        return [[1] * tokens for _ in prompts]

    monkeypatch.setattr(regen, "_hf_generate", hf_generate)
    target = load_target(str(tiny_llama_dir))
    request = dataclasses.replace(_request(), target=SimpleNamespace(fingerprint="f" * 16, model=target.model), forward_path="auto")
    sources = []
    for left_behind in (available_cores(), available_cores() + 1):
        torch.set_num_threads(left_behind)
        sources.append(resolve_engine(request, PROMPTS, requested="hf", threads=0, deadline=None).facts["forward_path_source"])
    assert sources == ["measured", "cached"]
