"""What the engine is: `EngineLayout`, every fact of a vLLM engine that decides how the policy must compute.

`engine_layout` is the one reader, for a colocated engine and a server alike; `worker_facts` is what it asks the
engine's own processes. `cpu_vector_isa` and `vllm_cpu_kernel_library` name what this process's CPU code runs.
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass, field

from ..machine import cpu_vector_isa, vllm_cpu_kernel_library
from .dispatch import is_vllm_cpu, vllm_cpu_weight_sync_fix_applied


@dataclass
class EngineLayout:
    """Every fact of the engine that the policy must reproduce, read once from the engine (`engine_layout`).

    One object for a colocated engine and for a vLLM server alike: both are read by the same function from the same
    form (the JSON a server answers at `/server_info`, which a colocated engine's configuration is turned into). The
    trainer compares it field by field with what the policy computes (`policy_differences`), hashes the fields it
    decides itself into the compile cache's key (`build.engine_cache_root`), records it in `run_info` and in
    mismatch.jsonl's header, and applies it to the policy with one function (`apply_to_policy`).
    """

    vllm_version: str
    platform: str
    compile_mode: str
    enforce_eager: bool
    custom_ops: list[str] = field(default_factory=list)
    cache_dir: str | None = None
    weight_sync_fix: bool = False
    backend: str = ""
    splitting_ops: list[str] = field(default_factory=list)
    use_inductor_graph_partition: bool = False
    ir_op_priority: dict[str, list[str]] = field(default_factory=dict)
    torch_version: str = ""
    inductor_dir: str | None = None
    cpu_isa: str | None = None
    # The engine's context length: it decides LongRoPE's factor set (long when above the original length).
    max_model_len: int | None = None
    # The row-block size its linears compute with (`trl_roundalign.engine.gemm`; 0: plain F.linear; None: vLLM's own
    # kernels, or not known). Read from the loaded model's linears, in the engine's own processes.
    gemm_block_rows: int | None = None
    # The row floor its linears compute with where they have no row blocks (`gemm.GemmSchedule.min_rows`: a call of
    # fewer rows is zero-padded to this many; 0: none; None: vLLM's own kernels, or not known). Read like the blocks.
    gemm_min_rows: int | None = None
    # vLLM's model code: "auto"/"vllm" (its own modules, or its Transformers backend for a family it has no module
    # for), "transformers" (the Transformers backend asked for explicitly).
    model_impl: str = "auto"
    # Shards of every linear: a row-parallel layer sums partial products across them (an order no profile measures).
    tensor_parallel_size: int = 1
    # Engine cores behind one server (`--data-parallel-size`): each schedules its own requests.
    data_parallel_size: int = 1
    # The dtype of the engine's weights and activations ("bfloat16"); None where not reported.
    dtype: str | None = None
    # The KV cache's block size: it selects vLLM-CPU's attention kernel path.
    kv_block_size: int | None = None
    # The most tokens one engine step computes (its prefill chunk budget): the row counts its linears reach.
    max_num_batched_tokens: int | None = None
    # TP > 1: the transport the ranks' all-reduce sums with (vLLM-CPU: `_CPUSHMDistributed`), read in a worker.
    all_reduce: str | None = None
    # vLLM-CPU's x86 kernel library the engine's processes load (`_C`, `_C_AVX512`, `_C_AVX2`).
    kernel_library: str | None = None
    # vLLM-CPU's attention may split one decoding sequence's keys over threads (`VLLM_CPU_ATTN_SPLIT_KV`, on by
    # default): where the split falls depends on the other sequences of the step, so a sampled token's log-prob
    # depends on its batch. Exact mode needs it off (`ops.attention.sampled_from`). Read in a worker.
    attention_kv_split: bool | None = None
    # The OpenMP threads the engine's attention kernel schedules its work over (`torch.get_num_threads()` in a worker).
    attention_threads: int | None = None
    # Whether its attention computes each prompt's prefill in a kernel call of its own (`engine.prefill`; read in a
    # worker), and whether its scheduler may split a prompt over steps or prefill only a prompt's uncached tail (the
    # scheduler and cache configuration). Exact mode reproduces a prompt of any length only with all three
    # (`prompts_alone`; chunking is reproduced where the scheduler records it, `schedule_recorded`); otherwise up to
    # the prompt horizon it measures at start-up.
    attention_prefill_alone: bool | None = None
    chunked_prefill: bool | None = None
    prefix_caching: bool | None = None
    # vLLM's cache strategy for mamba-like layers (Qwen3.5's gated delta-net): "align" (its default with prefix caching)
    # makes its scheduler cut a hybrid model's prefills at KV block boundaries; None where not reported.
    mamba_cache_mode: str | None = None
    # Whether its scheduler records each request's schedule (`engine.schedule.RecordingScheduler`, exact mode's): then a
    # chunked prefill's cuts are read per request and reproduced (`prompts_alone` holds with chunking on).
    schedule_recorded: bool | None = None
    # The fp32 lanes of each RMSNorm reduction of its compiled code, in forward order (`engine.lanes`), read by its
    # worker from its own compile cache, and how many fused kernels its embedding took (`EngineLanes`); None where not
    # read (`lanes_unread` says why): a server's, which the trainer cannot read itself.
    reduction_lanes: list[int] | None = None
    embedding_kernels: int | None = None
    lanes_unread: str | None = None
    # Gated delta-net layers (Qwen3.5): how the engine computes their core, read in a worker from its loaded layers
    # (`gdn_facts_in_worker`): {"conv": "torch" | "cpp", "conv_state_dtype", "ssm_state_dtype"}; None where the model
    # has none. The trainer's exact forward computes with it (`ops.gated_delta_net.GdnForm`).
    gated_delta_net: dict | None = None

    @property
    def compiled(self) -> bool:
        return not self.enforce_eager and self.compile_mode not in ("NONE", "0", "CompilationMode.NONE")

    @property
    def piecewise(self) -> bool:
        """Compiled with the graph split at the attention ops (vLLM's CUDA default, `VLLM_COMPILE`)."""
        return (
            self.compiled
            and self.compile_mode == "VLLM_COMPILE"
            and not self.use_inductor_graph_partition
            and any("attention" in op for op in self.splitting_ops)
        )

    @property
    def prefills_cut_at_blocks(self) -> bool:
        """Whether the scheduler cuts prefills at KV block boundaries (a hybrid model under mamba_cache_mode "align"):
        a long prompt is then chunked whatever the step budget."""
        return bool(self.gated_delta_net) and self.mamba_cache_mode == "align"

    @property
    def prompts_alone(self) -> bool:
        """Every prompt's prefill computed in kernel calls of its own (whole, or in the chunks and from the prefix hits
        the scheduler recorded): its bits do not depend on its step's company, and the trainer reproduces them."""
        return bool(self.attention_prefill_alone) and (
            bool(self.schedule_recorded) or (self.chunked_prefill is False and self.prefix_caching is False))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["compiled"] = self.compiled
        d["piecewise"] = self.piecewise
        d["prompts_alone"] = self.prompts_alone
        d["prefills_cut_at_blocks"] = self.prefills_cut_at_blocks
        return d


EngineInfo = EngineLayout  # the name it had before it held the whole layout


class LayoutMismatch(ValueError):
    """A fact of the engine's layout the policy does not compute as the engine does (one line: the field, both values)."""


# The key of `additional_config` under which the package's own facts of an engine travel to the one reader: read from
# the engine's workers (`worker_facts`, the one producer) and put under it (`with_worker_facts`), for a colocated engine
# (`llm.collective_rpc`) and for a server (`trl-roundalign serve` gives its workers `WorkerFacts`, which the trainer
# calls through the server's /collective_rpc); a server of an older release reported them there itself.
FACTS_KEY = "roundalign_layout"
# The worker extension `trl-roundalign serve` starts the server's workers with, and the method the trainer calls.
WORKER_EXTENSION = f"{__name__}.WorkerFacts"
WORKER_FACTS_METHOD = "roundalign_worker_facts"


class WorkerFacts:
    """A vLLM worker extension (`--worker-extension-cls`): the worker answers `worker_facts` about itself, and the
    digests of its weights, through the engine's collective RPC, which a server exposes as /collective_rpc (dev mode,
    token-guarded)."""

    def roundalign_worker_facts(self) -> dict:
        return worker_facts(self)

    def roundalign_weight_digests(self) -> dict:
        """A digest of each weight the worker computes with, in the trainer's names (`engine.weight_digest`)."""
        from .weight_digest import worker_digests

        return worker_digests(self)


def with_worker_facts(server_info: dict, facts: dict | None) -> dict:
    """`server_info` (a `/server_info` JSON answer) with the workers' `facts` under `additional_config[FACTS_KEY]`,
    over what it held there: the form `layout_or_why` reads."""
    config = dict(server_info.get("vllm_config") or {})
    extra = dict(config.get("additional_config") or {})
    extra[FACTS_KEY] = {**(extra.get(FACTS_KEY) or {}), **(facts or {})}
    return {**server_info, "vllm_config": {**config, "additional_config": extra}}


def worker_facts(worker=None) -> dict:
    """What an engine's worker process computes with, read inside it (`llm.collective_rpc(worker_facts)`): the
    row-block size its linears were dispatched with (from the loaded model), its Inductor folder, its TP all-reduce
    transport, the vector ISA and vLLM-CPU kernel library its process uses."""
    import os

    rows = min_rows = None
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    if model is not None:
        sizes = {(m._roundalign_block_rows, getattr(m, "_roundalign_min_rows", 0))
                 for m in model.modules() if hasattr(m, "_roundalign_block_rows")}
        if len(sizes) > 1:
            raise RuntimeError(f"the engine's linears were dispatched with different GEMM schedules: {sorted(sizes)}")
        rows, min_rows = sizes.pop() if sizes else (None, None)
    import torch

    from .tp import colocated_all_reduce

    isa = cpu_vector_isa() if is_vllm_cpu() else None
    kv_split = None
    if is_vllm_cpu():
        from vllm import envs

        kv_split = bool(envs.VLLM_CPU_ATTN_SPLIT_KV)  # as the engine's attention metadata builder reads it
    from .prefill import prefill_alone_in_worker

    lanes = {}
    if is_vllm_cpu() and worker is not None:  # its own compile cache, read where it lives (a server's: its host)
        from .inductor_code import lanes_in_worker

        lanes = lanes_in_worker(getattr(worker, "vllm_config", None))
    return {
        **lanes,
        "gated_delta_net": gdn_facts_in_worker(model),
        "attention_kv_split": kv_split,
        "attention_prefill_alone": prefill_alone_in_worker(getattr(worker, "vllm_config", None)),
        "attention_threads": torch.get_num_threads() if is_vllm_cpu() else None,
        "gemm_block_rows": rows,
        "gemm_min_rows": min_rows,
        "inductor_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "all_reduce": colocated_all_reduce(),
        "cpu_isa": isa[0] if isa else None,
        "kernel_library": vllm_cpu_kernel_library() if is_vllm_cpu() else None,
        "weight_sync_fix": bool(is_vllm_cpu() and vllm_cpu_weight_sync_fix_applied()),
    }


def gdn_facts_in_worker(model) -> dict | None:
    """How the engine's gated delta-net layers compute their core (`EngineLayout.gated_delta_net`), read from the loaded
    model in its worker: the conv path vLLM-CPU's `gdn_attention` takes (C++ with packed weights where its predicate,
    evaluated here in the engine's process, says so; else vLLM's torch conv) and its state caches' dtypes. None without
    such layers (or before the caches exist)."""
    if model is None:
        return None
    layers = [m for m in model.modules() if type(m).__name__ == "QwenGatedDeltaNetAttention"]
    if not layers:
        return None
    import torch

    from ..ops.gated_delta_net import cpp_conv_here

    cache = getattr(layers[0], "kv_cache", None)
    if not cache or len(cache) < 2 or not isinstance(cache[0], torch.Tensor):
        return None
    return {"conv": "cpp" if cpp_conv_here() else "torch", "conv_state_dtype": str(cache[0].dtype).removeprefix("torch."),
            "ssm_state_dtype": str(cache[1].dtype).removeprefix("torch."), "layers": len(layers)}


def server_info_of(llm_or_config) -> dict:
    """A built engine's `/server_info` (`config_format=json`), as a vLLM server answers it, with the package's facts
    of its workers under `additional_config[FACTS_KEY]`: what `engine_layout` reads for a colocated engine."""
    import pydantic
    import torch
    import vllm
    from vllm.config import VllmConfig

    is_llm = hasattr(llm_or_config, "llm_engine")
    cfg = llm_or_config.llm_engine.vllm_config if is_llm else llm_or_config
    if not hasattr(cfg, "compilation_config"):
        raise TypeError(f"Expected a vllm.LLM or VllmConfig, got {type(llm_or_config).__name__}.")
    config = pydantic.TypeAdapter(VllmConfig).dump_python(cfg, mode="json", fallback=str)
    if is_llm:
        facts = llm_or_config.collective_rpc(worker_facts)[0]
    else:  # a configuration without an engine: this process's facts
        facts = {k: v for k, v in worker_facts().items() if k not in ("gemm_block_rows", "gemm_min_rows", "inductor_dir")}
        from .prefill import prefill_alone_in_worker

        facts["attention_prefill_alone"] = prefill_alone_in_worker(cfg)
    answer = {"vllm_config": config, "system_env": {"vllm_version": vllm.__version__, "torch_version": torch.__version__}}
    return with_worker_facts(answer, facts)


_READ: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def engine_layout(source) -> EngineLayout:
    """THE reader of the engine's layout: from a built `vllm.LLM` (read once per engine, right after it is built, and
    remembered), a `VllmConfig`, or a vLLM server's `/server_info` JSON (`config_format=json`).

    Raises:
        ValueError: a `/server_info` answer that does not say on which platform the engine runs (`layout_or_why`
            returns the reason instead).
    """
    if isinstance(source, dict):
        layout, why = layout_or_why(source)
        if layout is None:
            raise ValueError(f"The engine's layout cannot be read: {why}.")
        return layout
    if hasattr(source, "llm_engine"):
        if source not in _READ:
            _READ[source] = layout_or_why(server_info_of(source))[0]
        return _READ[source]
    return layout_or_why(server_info_of(source))[0]


def engine_info(llm_or_config) -> EngineLayout:
    """`engine_layout` of a built engine (or its `VllmConfig`): the name the reader had before."""
    return engine_layout(llm_or_config)


def _int_or_none(value) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _records_schedules(scheduler_cls) -> bool | None:
    """Whether an engine's scheduler class (a dotted name or the class, as its configuration holds it) is the
    project's recording scheduler or a subclass of it; None where the configuration does not say."""
    if scheduler_cls is None:
        return None
    from .schedule import RECORDING_SCHEDULER, RecordingScheduler  # an engine's configuration: vLLM is there

    if isinstance(scheduler_cls, type):
        return issubclass(scheduler_cls, RecordingScheduler)
    return str(scheduler_cls) == RECORDING_SCHEDULER


def _bool_or_none(value) -> bool | None:
    return None if value is None else bool(value)


def _dtype_name(value) -> str | None:
    if value in (None, "", "auto"):
        return None
    return str(value).removeprefix("torch.")


def layout_or_why(server_info: dict) -> tuple[EngineLayout | None, str]:
    """`(EngineLayout or None, why)` from a `/server_info` JSON answer (a server's, or `server_info_of` an engine's).

    The platform comes from `device_config.device`; an answer that does not name it gives None with the reason: the
    caller must not assume one. Facts the answer does not hold stay None (unknown), never guessed.
    """
    cfg = server_info.get("vllm_config") if isinstance(server_info, dict) else None
    if not isinstance(cfg, dict):
        return None, "its /server_info has no vllm_config in JSON form"
    system = server_info.get("system_env") or {}
    device = str((cfg.get("device_config") or {}).get("device") or "").split(":")[0]
    if device in ("", "auto", "None"):
        return None, f"its /server_info names no device (device_config: {cfg.get('device_config')!r})"
    cc = cfg.get("compilation_config") or {}
    mode = cc.get("mode")
    if isinstance(mode, int):
        from vllm.config import CompilationMode

        mode = CompilationMode(mode).name
    priority = {
        k: list(v) for k, v in ((cfg.get("kernel_config") or {}).get("ir_op_priority") or {}).items()
        if k in ("rms_norm", "fused_add_rms_norm") and v is not None
    }
    model = cfg.get("model_config") or {}
    extra = cfg.get("additional_config") or {}
    facts = extra.get(FACTS_KEY) or {}
    rows = facts.get("gemm_block_rows", extra.get("roundalign_gemm_block_rows"))  # the older servers' key
    info = EngineLayout(
        vllm_version=str(system.get("vllm_version") or ""),
        platform=device,
        compile_mode=str(mode),
        enforce_eager=bool(model.get("enforce_eager")),
        custom_ops=list(cc.get("custom_ops") or []),
        cache_dir=cc.get("local_cache_dir") or None,
        weight_sync_fix=bool(facts.get("weight_sync_fix", False)),
        backend=str(cc.get("backend") or ""),
        splitting_ops=list(cc.get("splitting_ops") or []),
        use_inductor_graph_partition=bool(cc.get("use_inductor_graph_partition")),
        ir_op_priority=priority,
        torch_version=str(system.get("torch_version") or ""),
        inductor_dir=facts.get("inductor_dir") if "torch_aot_compile" in str(facts.get("inductor_dir")) else None,
        cpu_isa=facts.get("cpu_isa"),
        max_model_len=_int_or_none(model.get("max_model_len")),
        gemm_block_rows=_int_or_none(rows),
        gemm_min_rows=_int_or_none(facts.get("gemm_min_rows", 0 if rows is not None else None)),
        model_impl=str(model.get("model_impl") or "auto"),
        tensor_parallel_size=_int_or_none((cfg.get("parallel_config") or {}).get("tensor_parallel_size")) or 1,
        data_parallel_size=_int_or_none((cfg.get("parallel_config") or {}).get("data_parallel_size")) or 1,
        dtype=_dtype_name(model.get("dtype")),
        kv_block_size=_int_or_none((cfg.get("cache_config") or {}).get("block_size")),
        max_num_batched_tokens=_int_or_none((cfg.get("scheduler_config") or {}).get("max_num_batched_tokens")),
        all_reduce=facts.get("all_reduce"),
        kernel_library=facts.get("kernel_library"),
        attention_kv_split=facts.get("attention_kv_split"),
        attention_threads=_int_or_none(facts.get("attention_threads")),
        attention_prefill_alone=facts.get("attention_prefill_alone"),
        chunked_prefill=_bool_or_none((cfg.get("scheduler_config") or {}).get("enable_chunked_prefill")),
        prefix_caching=_bool_or_none((cfg.get("cache_config") or {}).get("enable_prefix_caching")),
        mamba_cache_mode=(cfg.get("cache_config") or {}).get("mamba_cache_mode"),
        schedule_recorded=_records_schedules((cfg.get("scheduler_config") or {}).get("scheduler_cls")),
        reduction_lanes=[int(v) for v in facts["reduction_lanes"]] if facts.get("reduction_lanes") else None,
        embedding_kernels=_int_or_none(facts.get("embedding_kernels")),
        lanes_unread=facts.get("lanes_unread"),
        gated_delta_net=dict(facts["gated_delta_net"]) if facts.get("gated_delta_net") else None,
    )
    if mode is None and not info.enforce_eager:
        return info, f"{device}, compile mode not reported"
    return info, f"{device}, {'compiled' if info.compiled else 'eager'} ({info.compile_mode})"


def apply_to_policy(model, layout: EngineLayout | None, *, tensor_parallel: int = 1) -> None:
    """Make `model` (the policy, or the reference model) compute its linears as the engine's do: the engine's GEMM
    row blocks (`gemm.install_row_blocked_linears`; none where the layout has none) and its row-parallel sums at
    `tensor_parallel` > 1 (the engine's TP size where the aligned regions are on; `tp.install_tp_linears`, after the
    row blocks, whose forward it replaces on o_proj/down_proj). The one function that applies the layout."""
    from .gemm import install_row_blocked_linears
    from .tp import install_tp_linears

    if layout is None:
        return
    rows, min_rows = int(layout.gemm_block_rows or 0), int(layout.gemm_min_rows or 0)
    install_row_blocked_linears(model, rows, min_rows)  # none removes a schedule an earlier layout installed
    if tensor_parallel > 1 or any(getattr(m, "__dict__", {}).get("_roundalign_tp") for m in model.modules()):
        install_tp_linears(model, tensor_parallel, rows, min_rows)


def policy_facts(model) -> dict:
    """What `model` computes with, read back from it: its parameters' dtype, the row-block size its linears compute
    with (0: plain `F.linear`; "mixed" where they differ) and the TP size its row-parallel linears sum as (1: none)."""
    import torch

    from .gemm import module_schedule
    from .tp import _MARK as TP

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    schedules = {module_schedule(m) for m in linears}
    rows = {s.block_rows for s in schedules} or {0}
    min_rows = {s.min_rows for s in schedules} or {0}
    tps = {m.__dict__[TP][0] for m in linears if TP in m.__dict__} or {1}
    return {
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "gemm_block_rows": rows.pop() if len(rows) == 1 else "mixed",
        "gemm_min_rows": min_rows.pop() if len(min_rows) == 1 else "mixed",
        "tensor_parallel_size": tps.pop() if len(tps) == 1 else "mixed",
        # The engine's attention kernel in the policy (region "attention"): it recomputes each sampled token in
        # decode form with the keys on one thread, which reproduces a sampler that never splits them, and shares
        # its work among this process's threads as the engine's schedule does among its own.
        "attention_kv_split": False if _computes_engine_attention(model) else None,
        "attention_threads": _attention_threads(model) if _computes_engine_attention(model) else None,
    }


def _attention_threads(model) -> int:
    """The threads the policy's engine attention computes with: those it was patched with (a server's count), else
    this process's."""
    import torch

    given = {st.attention_threads for m in model.modules() if (st := m.__dict__.get("_roundalign")) is not None
             and getattr(st, "attention_threads", None) is not None}
    return given.pop() if len(given) == 1 else torch.get_num_threads()


def _computes_engine_attention(model) -> bool:
    """Whether a patched module of `model` computes region "attention" (the state `apply_roundalign` leaves)."""
    return any("attention" in getattr(m.__dict__.get("_roundalign"), "regions", ()) for m in model.modules())


# The layout's fields the policy reproduces (compared at start-up), and what to do where one differs.
_REPRODUCED = {
    "dtype": "load the policy in the engine's dtype (model_init_kwargs={{'dtype': '{engine}'}}) or run the engine in "
             "the policy's (vllm_engine_kwargs={{'dtype': '{policy}'}}, or the server's --dtype {policy})",
    "gemm_block_rows": "build the trainer in a fresh process (something else changed the policy's linears)",
    "gemm_min_rows": "build the trainer in a fresh process (something else changed the policy's linears)",
    "tensor_parallel_size": "build the trainer in a fresh process (something else changed the policy's linears)",
    "attention_threads": "the kernel's schedule shares a prompt's prefill among the threads, so its bits depend on "
                         "their number. Run the trainer with the engine's thread count (torch.set_num_threads({engine}) "
                         "before building it, or OMP_NUM_THREADS={engine}), or drop 'attention'",
    "attention_kv_split": "its sampler's log-probs then depend on which sequences share a decode step. Start the "
                          "engine with VLLM_CPU_ATTN_SPLIT_KV=0 in its environment (the trainer sets it for a colocated "
                          "engine it builds first in its process; `trl-roundalign serve` sets it), or drop 'attention'",
}


def layout_differences(layout: EngineLayout, facts: dict, *, tensor_parallel: bool, fields=None) -> list[str]:
    """One line per field of `layout` the policy (`policy_facts`) does not compute as the engine does; unknown engine
    facts (None) compare with nothing. `tensor_parallel`: whether the policy reproduces the engine's TP sums (the
    aligned regions are on). `fields`: only these (default: every field the policy reproduces)."""
    engine = {
        "dtype": layout.dtype,
        "gemm_block_rows": int(layout.gemm_block_rows or 0),
        "gemm_min_rows": int(layout.gemm_min_rows or 0),
        "tensor_parallel_size": int(layout.tensor_parallel_size or 1) if tensor_parallel else 1,
        "attention_kv_split": layout.attention_kv_split,
        "attention_threads": layout.attention_threads,
    }
    out = []
    for name, value in engine.items():
        if fields is not None and name not in fields:
            continue
        if name in ("attention_kv_split", "attention_threads") and facts.get(name) is None:
            continue  # the policy's attention is not the engine's kernel: nothing of the schedule is reproduced
        if value is not None and facts.get(name) != value:
            how = _REPRODUCED[name].format(engine=value, policy=facts.get(name))
            out.append(f"The engine layout's {name} is {value} but the policy computes with {facts.get(name)}: {how}.")
    return out
