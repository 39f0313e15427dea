"""Server mode against a TP=2 vLLM-CPU server (issue 27; docs/numerics.md, "Tensor parallelism").

The test starts `trl-roundalign serve --tensor-parallel-size 2` itself on 127.0.0.1 (two
worker processes, one core per rank: the module binds them, `VLLM_CPU_OMP_THREADS_BIND=0|1`, and gives them the
weight-sync fix), and trains 2 steps of the tiny Qwen3 with the three regions against it. Claims:

- the trainer reads TP=2 from `/server_info` and computes o_proj/down_proj as the server's ranks sum them
  (`tp.install_tp_linears`), recorded in the mismatch.jsonl header; the start-up check passes with that form, and
  scored again without it the same profile is further from the server (k3 higher);
- weights sync over gloo to both TP workers: the server's log-probs follow the trainer's after training;
- the mismatch metrics are logged every step.
"""

from __future__ import annotations

import functools
import glob
import json
import math

import pytest
import torch
from helpers.server import TEXT, Server, free_port, train_and_check_the_server_follows  # noqa: E402
from helpers.server import token as token  # noqa: F401,E402  (autouse: the server's token in the environment)
from helpers.trainer import make_config, varied_reward  # noqa: E402

from trl_roundalign.local_models import tiny_model

ONE_GRAPH_TP2 = dict(
    vllm_version="0.31.0", platform="cpu", compile_mode="DYNAMO_TRACE_ONCE", enforce_eager=False, custom_ops=["none"],
    backend="inductor", torch_version="2.13.0+cpu", tensor_parallel_size=2,
)


def test_server_tp_reads_the_size_and_refuses_unmeasured_layouts_in_one_line():
    """No server: `server_tp_refusal` on the layouts a /server_info reading can give."""
    from trl_roundalign.engine import EngineInfo, UnknownEngineConfiguration, vllm_cpu_kernel_library
    from trl_roundalign.trainer.server_check import server_tp_refusal

    url = "http://127.0.0.1:1"
    server_tp_refusal(None, "qwen3", url)  # platform unknown: nothing sharded, nothing refused
    server_tp_refusal(EngineInfo(**{**ONE_GRAPH_TP2, "tensor_parallel_size": 1}), "qwen3", url)
    refused = {
        "eager": {"compile_mode": "NONE", "enforce_eager": True},
        "tp4": {"tensor_parallel_size": 4},
        "gpu": {"platform": "cuda", "torch_version": "2.13.0+cu130"},
    }
    for why, change in refused.items():
        with pytest.raises(UnknownEngineConfiguration, match=r"^This engine's tensor parallel size is \d: ") as err:
            server_tp_refusal(EngineInfo(**{**ONE_GRAPH_TP2, **change}), "qwen3", url)
        assert "\n" not in str(err.value), (why, str(err.value))
    if vllm_cpu_kernel_library() != "_C":
        pytest.skip("TP=2 is aligned with vLLM-CPU's _C library only (the shared-memory all-reduce)")
    server_tp_refusal(EngineInfo(**ONE_GRAPH_TP2), "qwen3", url)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: its row-parallel sums are measured for llama, qwen3, "):
        server_tp_refusal(EngineInfo(**ONE_GRAPH_TP2), "olmo2", url)


STARTUP_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def tp2_server(tmp_path_factory):
    from trl_roundalign.engine import vllm_cpu_kernel_library

    if vllm_cpu_kernel_library() != "_C":
        # Where the server's TP layout is not measured the trainer refuses it in one line (the first test here).
        pytest.skip(f"TP=2 is aligned with vLLM-CPU's _C library; this CPU loads {vllm_cpu_kernel_library()}")
    folder = tmp_path_factory.mktemp("vllm-server-tp2")
    # The test owns the server's compile cache, so that it can read the server's compiled code (its reduction lanes).
    srv = Server(tiny_model("qwen3"), folder / "server.log", extra=["--tensor-parallel-size", "2"],
                 env={"VLLM_CACHE_ROOT": str(folder / "vllm")})
    srv.cache_root = folder / "vllm"
    try:
        srv.wait_ready(STARTUP_TIMEOUT_S)
        yield srv
    finally:
        srv.stop()


@pytest.mark.full  # a TP=2 server, 81 s for the three; make test-full: kept out of make test for its time (docs/evidence.md, 'make test-full')
@pytest.mark.vllm
def test_server_mode_trains_against_a_tp2_server_with_the_tp_form(tp2_server, tmp_path):
    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.engine import inductor_reduction_lanes
    from trl_roundalign.engine.tp import _MARK, remove_tp_linears
    from trl_roundalign.profiles import ALL_REGIONS
    from trl_roundalign.trainer.startup_check import _score, server_prompt_logprobs, verification_sequences

    server = tp2_server
    with server.log_on_failure():
        assert "VLLM_CPU_OMP_THREADS_BIND=0|1" in server.log.read_text(errors="replace")
        updates_before = server.log.read_text(errors="replace").count('"POST /update_weights HTTP/1.1" 200')
        args = make_config(
            tmp_path, max_steps=2, vllm_mode="server", vllm_server_base_url=server.url, vllm_server_timeout=60,
            vllm_group_port=free_port(), roundalign_profile="auto", learning_rate=1e-3,
        )  # fmt: skip
        trainer = RoundAlignGRPOTrainer(
            model=tiny_model("qwen3"), reward_funcs=varied_reward, args=args,
            train_dataset=arithmetic_dataset("train[:16]"),
        )  # fmt: skip
        client = trainer.vllm_generation.vllm_client
        try:
            assert client.get_world_size() == 2  # the server's ranks, each of which joined the trainer's gloo group
            ver = trainer.roundalign_verification
            assert ver is not None and ver.verdict == "ok" and ver.engine_profile == "vllm-compiled", ver
            assert ver.engine["tensor_parallel_size"] == 2 and ver.engine["compiled"], ver.engine
            assert trainer.roundalign_profile == "vllm-compiled"
            assert trainer.roundalign_report.regions == ("rope", "swiglu", "rmsnorm")
            tp_layers = [n for n, m in trainer.model.named_modules() if _MARK in m.__dict__]
            assert tp_layers and {n.rsplit(".", 1)[-1] for n in tp_layers} == {"o_proj", "down_proj"}, tp_layers
            assert trainer.roundalign_run_info()["tensor_parallel_size"] == 2

            # Exact, as in colocate mode: the server's reduction lanes read from its own compiled code (the test owns its
            # cache; server mode itself refuses exact profiles, since a trainer cannot read another process's cache), its
            # row blocks and attention block size from its layout. With the TP form every token of the check is
            # bit-identical to the TP=2 server; without it, not. (The non-exact profile's k3 cannot tell the two apart:
            # its own attention and reduction differences re-round every token; measured on the AMD AVX-512 kind 9.96e-7
            # with the form and 9.21e-7 without, within 0.5 paired standard errors.)
            tokenizer = trainer.processing_class
            seqs = verification_sequences(tokenizer)
            engine = server_prompt_logprobs(client, seqs)
            [compiled] = glob.glob(str(server.cache_root / "torch_compile_cache" / "torch_aot_compile" / "*"))
            lanes = inductor_reduction_lanes(compiled)
            layout = trainer.roundalign_layout
            score = functools.partial(_score, trainer.model, seqs, engine, ALL_REGIONS, "vllm-compiled-exact",
                                      args.roundalign_backend, lanes, layout.kv_block_size, layout.max_model_len)
            try:
                with torch.no_grad():
                    with_tp = score()
                    remove_tp_linears(trainer.model)
                    without_tp = score()
            finally:
                trainer.roundalign_report = trainer._install_patches()  # the run's patches and the TP form back
            print(f"exact vs the TP=2 server: with the TP form k3 {with_tp.kl_k3:.3g} ({with_tp.frac_bitwise_equal:.1%} "
                  f"bit-identical), without {without_tp.kl_k3:.3g} ({without_tp.frac_bitwise_equal:.1%})")
            assert with_tp.frac_bitwise_equal == 1.0 and with_tp.kl_k3 == 0.0, with_tp
            assert without_tp.frac_bitwise_equal < 1.0, without_tp
            assert _MARK in trainer.model.model.layers[0].mlp.down_proj.__dict__

            ids = tokenizer(TEXT)["input_ids"]
            train_and_check_the_server_follows(trainer, client, ids)
            # Each rank's shards, located in the trainer's tensors (o_proj and down_proj by columns, the rest by rows,
            # q/k/v and gate/up split out of their fused shards): all bit-identical to the trainer's after the syncs.
            weights = trainer.roundalign_verify_server_weights()
            print("weights against the TP=2 server:", weights.summary())
            assert weights.equal and weights.compared > len(list(trainer.model.parameters())), weights.summary()
            # Weights went over at start-up, before step 2's generation, and in the sync above: every one answered 200
            # once both TP workers had received them.
            updates = server.log.read_text(errors="replace").count('"POST /update_weights HTTP/1.1" 200')
            assert updates - updates_before == 3, (updates, updates_before)

            steps = [h for h in trainer.state.log_history if "mismatch/kl_k3" in h]
            assert [h["step"] for h in steps] == [1, 2]
            for h in steps:
                assert math.isfinite(h["mismatch/kl_k3"]) and h["mismatch/tokens"] > 0
            rows = (tmp_path / "mismatch.jsonl").read_text().splitlines()
            header = json.loads(rows[0])["run_info"]
            assert header["tensor_parallel_size"] == 2 and header["verification"]["engine"]["tensor_parallel_size"] == 2
            assert [json.loads(r)["step"] for r in rows[1:]] == [1, 2]

        finally:  # the trainer's gloo group with the server's ranks, closed before the server stops
            client.close_communicator()


@pytest.mark.full  # a TP=2 server, 81 s for the three; make test-full: kept out of make test for its time (docs/evidence.md, 'make test-full')
@pytest.mark.vllm
def test_an_explicit_profile_gets_the_tp_form_from_the_start_up_check(tp2_server, tmp_path):
    """`roundalign_profile='vllm-compiled'` (not 'auto'): the start-up check reads the TP size and installs the form;
    the eager profile, scored with it too, is told apart."""
    from helpers.server import server_trainer

    from trl_roundalign.engine.tp import _MARK

    with tp2_server.log_on_failure():
        trainer = server_trainer(tp2_server, tmp_path, "vllm-compiled")
        trainer.vllm_generation.vllm_client.close_communicator()
    assert trainer._tp == 2 and trainer.roundalign_run_info()["tensor_parallel_size"] == 2
    assert sum(_MARK in m.__dict__ for m in trainer.model.modules()) == 2 * trainer.model.config.num_hidden_layers
    ver = trainer.roundalign_verification
    assert ver.verdict == "ok" and ver.engine_profile == "vllm-compiled", ver
    chosen = next(c for c in ver.candidates if c.profile == "vllm-compiled")
    eager = next(c for c in ver.candidates if c.profile.startswith("vllm-eager"))
    assert eager.kl_k3 - chosen.kl_k3 > ver.k3_margin, ver


@pytest.mark.full  # a TP=2 server, 81 s for the three; make test-full: kept out of make test for its time (docs/evidence.md, 'make test-full')
def test_with_the_start_up_check_off_the_server_layout_is_still_followed(tp2_server, tmp_path):
    """`roundalign_verify_profile=False` and an explicit profile: nothing verifies, but the trainer still reads the
    server's /server_info for what it must reproduce (the TP form and the GEMM row blocks), rather than silently
    computing the TP=1 form."""
    from helpers.server import server_trainer

    from trl_roundalign.engine.tp import _MARK

    with tp2_server.log_on_failure():
        trainer = server_trainer(tp2_server, tmp_path, "vllm-compiled", roundalign_verify_profile=False)
        trainer.vllm_generation.vllm_client.close_communicator()
    assert trainer.roundalign_verification is None
    assert trainer._tp == 2 and trainer.roundalign_run_info()["tensor_parallel_size"] == 2
    assert sum(_MARK in m.__dict__ for m in trainer.model.modules()) == 2 * trainer.model.config.num_hidden_layers
