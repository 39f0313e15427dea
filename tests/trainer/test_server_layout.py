"""Server mode reads the server's whole layout from its /server_info and compares it with the policy (issue 37,
defect 3): a `--dtype float16` server against a bf16 policy used to train without a word, because the start-up check
only ranked profiles against each other and a dtype gap hurts every candidate alike."""

from __future__ import annotations

import pytest
from helpers.server import STARTUP_TIMEOUT_S, Server, free_port
from helpers.server import token as token  # noqa: F401  (autouse: the server's token in the environment)
from helpers.trainer import make_config, varied_reward

from trl_roundalign.local_models import tiny_model

pytestmark = pytest.mark.vllm


def test_a_float16_server_against_a_bf16_policy_is_refused_naming_the_dtype(tmp_path):
    from trl_roundalign import RoundAlignGRPOTrainer
    from trl_roundalign.data import arithmetic_dataset
    from trl_roundalign.engine.layout import LayoutMismatch

    server = Server(tiny_model("qwen3"), tmp_path / "server.log", extra=["--dtype", "float16"])
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        with server.log_on_failure():
            args = make_config(
                tmp_path / "run", max_steps=1, vllm_mode="server", vllm_server_base_url=server.url,
                vllm_server_timeout=60, vllm_group_port=free_port(), roundalign_profile="auto",
            )  # fmt: skip
            with pytest.raises(LayoutMismatch) as e:
                RoundAlignGRPOTrainer(
                    model=tiny_model("qwen3"), reward_funcs=varied_reward, args=args,
                    train_dataset=arithmetic_dataset("train[:8]"),
                )  # fmt: skip
        message = str(e.value)
        assert message.startswith("The engine layout's dtype is float16 but the policy computes with bfloat16: ")
        assert "--dtype bfloat16" in message and "\n" not in message
        # Refused before the start-up check pushed any weight to the server.
        assert '"POST /update_weights HTTP/1.1" 200' not in server.log.read_text(errors="replace")
    finally:
        server.stop()
