"""llama.cpp ``llama-server`` (source read at ggml-org/llama.cpp@0c1e57098; tests run the sdist build 11434).

- detect: ``GET /props`` answers 200 (SGLang and vLLM have no ``/props``). While the model loads, a middleware
  answers every path with 503, so a loading server is "cannot tell yet", never another kind.
- health: ``GET /health``: 200 ``{"status":"ok"}``, 503 ``{"error":{"message":"Loading model",..}}`` while loading.
- state: ``/props`` (``default_generation_settings.n_ctx`` per slot, ``total_slots``, ``model_path``,
  ``model_ftype``, ``build_info``), ``/slots`` (busy = ``is_processing`` count; 501 with ``--no-slots``: busy is
  unknown), ``/v1/models`` (served id; ``meta.ftype`` is the numeric ``llama_ftype``).
- tokens: ``POST /v1/chat/completions/input_tokens`` with the chat body (newest builds; the generation path),
  else ``/apply-template`` then ``/tokenize`` with ``add_special`` and ``parse_special`` (``/tokenize`` defaults
  to ``add_special:false``; generation tokenizes with both true).
- cache: ``POST /slots/{id}?action=erase`` for every slot — only with ``--slot-save-path`` (else 501
  ``not_supported_error``); without it a request skips the cache with ``cache_prompt: false``.
- errors: already nested, ``{"error":{"code","message","type"}}``; a context overflow adds ``n_prompt_tokens``
  and ``n_ctx`` (HTTP 400 ``exceed_context_size_error``, also for ``stream:true``).
- launch: ``llama-server`` (any path); ``--host`` (default 127.0.0.1), ``--port`` (default 8080); ready when
  ``/health`` answers 200 (503 while the model loads). ``launch_flags`` reads ``-m -c -b -ub -np -ngl -t -fa
  -ctk -ctv -kvu`` in every spelling llama.cpp's ``common/arg.cpp`` accepts.
- log (build 11434, ``common/log.cpp``: ``M.SS.mmm.uuu L `` timestamps): at the default verbosity (3) only the
  server's own lines — ``load_model: loading model``, ``llama_server: model loaded`` (their timestamps give
  the load time), ``load_model: initializing, n_slots = N, n_ctx_slot = C, kv_unified = 'B'``, and warnings
  such as ``Flash Attention not supported, set to disabled``. The loader's lines (``load_tensors: offloaded N/M
  layers to GPU``, ``model buffer size``, ``llama_kv_cache: size = ...``, ``llama_context: n_ctx``,
  ``flash_attn``, ``Flash Attention enabled``) are LLAMA_LOG_INFO, which ``common_log_get_verbosity`` maps to
  trace (4): they appear with ``-lv 4`` (or ``-v``). A build without a GPU backend prints no ``offloaded`` line
  (``llama_supports_gpu_offload`` is false). CUDA graphs: a CUDA build says ``USE_GRAPHS = 1`` in its
  ``system_info`` line when they are compiled in; whether they run is not logged by a release build (ggml-cuda's
  ``disabling CUDA graphs due to ...`` lines are debug builds' only, and ``GGML_CUDA_DISABLE_GRAPHS`` turns
  them off silently), so the dialect says "compiled in", never "on"; ``graphs reused`` in each request's timing
  lines counts ggml graph reuse, not CUDA graphs.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.engines.base import (
    Dialect,
    Facts,
    Message,
    PollError,
    TokenCount,
    as_dict,
    as_int,
    as_str,
    body_message,
    get_json,
    metrics_busy,
    model_card,
    short,
)
from proxy.engines.startup import LogFacts, clean_lines, flag_value, has_flag, program, size_bytes

#: llama_ftype numbers (``/v1/models`` ``meta.ftype``) of the common GGUF types
FTYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
               11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
               17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}  # fmt: skip


def ftype_name(v: object) -> str | None:
    if isinstance(v, str):
        return v or None
    i = as_int(v)
    return None if i is None else FTYPE_NAMES.get(i, f"ftype{i}")


#: bytes per element of the KV cache types llama.cpp accepts (``-ctk``/``-ctv``; ggml block size / elements)
CACHE_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "q4_1": 20 / 32,
                    "iq4_nl": 18 / 32, "q5_0": 22 / 32, "q5_1": 24 / 32}  # fmt: skip

#: (flag names) for each launch parameter ``launch_flags`` reads, as ``common/arg.cpp`` spells them
LAUNCH_FLAGS: dict[str, tuple[str, ...]] = {
    "model": ("-m", "--model"),
    "ctx_size": ("-c", "--ctx-size"),
    "batch_size": ("-b", "--batch-size"),
    "ubatch_size": ("-ub", "--ubatch-size"),
    "parallel": ("-np", "--parallel"),
    "gpu_layers": ("-ngl", "--gpu-layers", "--n-gpu-layers"),
    "threads": ("-t", "--threads"),
    "threads_batch": ("-tb", "--threads-batch"),
    "flash_attn": ("-fa", "--flash-attn"),
    "cache_type_k": ("-ctk", "--cache-type-k"),
    "cache_type_v": ("-ctv", "--cache-type-v"),
    "kv_unified_per_slot": ("--kv-unified-per-slot",),
    "fit": ("-fit", "--fit"),
    "verbosity": ("-lv", "--verbosity", "--log-verbosity"),
}

_TS = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) [A-Z] ")
_LOADING = re.compile(r"load_model: loading model '(.*)'")
_LOADED = re.compile(r"llama_server: model loaded")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_MODEL_BUF = re.compile(r"load_tensors:\s+(\S+) model buffer size =\s+([0-9.]+) (MiB|GiB)")
_KV_SIZE = re.compile(
    r"llama_kv_cache: size =\s+([0-9.]+) (MiB|GiB) \(\s*(\d+) cells,\s+(\d+) layers,\s+(\d+)/(\d+) seqs\), "
    r"K \((\w+)\):.*V \((\w+)\)"
)
_CTX = re.compile(r"llama_context: n_ctx\s+= (\d+)$")
_INIT = re.compile(r"load_model: initializing, n_slots = (\d+), n_ctx_slot = (\d+), kv_unified = '(\w+)'")
_FA_PARAM = re.compile(r"llama_context: flash_attn\s+= (\w+)")
_FA_RESOLVED = re.compile(
    r"Flash Attention (enabled|not supported, set to disabled)|Flash Attention was auto, set to (\w+)"
)
_N_LAYER = re.compile(r"print_info: n_layer\s+= (\d+)$")
_DEVICE = re.compile(r"using device (\w+) \(([^)]*)\)")
_GRAPHS_OFF = re.compile(r"disabling CUDA graphs due to (.*)")
#: system_info: a CUDA build with graphs compiled in (GGML_CUDA_GRAPHS)
_GRAPHS_BUILD = re.compile(r"\| CUDA : .*\bUSE_GRAPHS = 1\b")


def _stamp(line: str) -> float | None:
    m = _TS.match(line)
    if not m:
        return None
    mins, secs, ms, us = (int(x) for x in m.groups())
    return mins * 60 + secs + ms / 1e3 + us / 1e6


def launch_flags(argv: Sequence[str]) -> dict[str, str | int | bool]:
    """The launch parameters a llama-server command line sets (absent: llama.cpp's default applies)."""
    out: dict[str, str | int | bool] = {}
    for key, names in LAUNCH_FLAGS.items():
        v = flag_value(argv, *names)
        if v is not None:
            out[key] = int(v) if v.lstrip("-").isdigit() else v  # -ngl also takes auto / all
    if has_flag(argv, "-kvu", "--kv-unified"):
        out["kv_unified"] = True
    if has_flag(argv, "-no-kvu", "--no-kv-unified"):
        out["kv_unified"] = False
    if has_flag(argv, "--no-mmap"):
        out["mmap"] = False
    if "flash_attn" in out and str(out["flash_attn"]).startswith("-"):  # old builds: a bare -fa switch
        out["flash_attn"] = "on"
    return out


@dataclass
class _LogScan:
    """What ``LlamaCpp.parse_log`` has read of a start-up log so far, line by line; ``facts`` concludes."""

    #: fact name -> the log line(s) it was read from
    ev: dict[str, str] = field(default_factory=dict)
    t_loading: float | None = None
    t_loaded: float | None = None
    #: the weights' buffers, on the GPU and in host memory; whether any loader line was seen at all
    gpu_w: int = 0
    host_w: int = 0
    any_gpu_buf: bool = False
    loader: bool = False
    offloaded: int | None = None
    total: int | None = None
    n_layer: int | None = None
    ctx: int | None = None
    slots: int | None = None
    per_slot: int | None = None
    unified: bool | None = None
    kv_bytes: int | None = None
    kv_tokens: int | None = None
    kv_type: str | None = None
    fa: str | None = None
    graphs: str | None = None
    graphs_built: str | None = None
    devices: list[str] = field(default_factory=list)

    def read(self, line: str) -> None:
        ev = self.ev
        if _LOADING.search(line):
            self.t_loading, ev["load_s"] = _stamp(line), line
        elif _LOADED.search(line):
            self.t_loaded = _stamp(line)
            ev["load_s"] = ev.get("load_s", "") + "\n" + line
        elif m := _OFFLOADED.search(line):
            self.offloaded, self.total, ev["layers_offloaded"] = int(m[1]), int(m[2]), line
        elif m := _MODEL_BUF.search(line):
            self.loader = True
            n = size_bytes(m[2], m[3])
            if m[1].upper().startswith("CPU") or "HOST" in m[1].upper():
                self.host_w += n
            else:
                self.gpu_w, self.any_gpu_buf = self.gpu_w + n, True
            ev["weights_bytes"] = ev.get("weights_bytes", "") + ("\n" if "weights_bytes" in ev else "") + line
        elif m := _KV_SIZE.search(line):
            self.kv_bytes = size_bytes(m[1], m[2])
            self.kv_tokens = int(m[3]) * int(m[6])  # cells per stream x streams
            self.kv_type = m[7] if m[7] == m[8] else f"K {m[7]}, V {m[8]}"
            ev["kv_cache_bytes"] = line
        elif m := _CTX.search(line):
            self.ctx, ev["context"] = int(m[1]), line
        elif m := _INIT.search(line):
            self.slots, self.per_slot, self.unified = int(m[1]), int(m[2]), m[3] == "true"
            ev["slots"] = line
        elif m := _FA_RESOLVED.search(line):
            self.fa = "enabled" if (m[1] == "enabled" or m[2] == "enabled") else "disabled"
            ev["flash_attention"] = line
        elif (m := _FA_PARAM.search(line)) and self.fa is None:
            self.fa, ev["flash_attention"] = m[1], line
        elif m := _N_LAYER.search(line):
            self.n_layer = int(m[1])
        elif m := _DEVICE.search(line):
            self.devices.append(f"{m[1]} ({m[2]})")
        elif _GRAPHS_OFF.search(line):
            self.graphs, ev["cuda_graphs"] = "off", line
        elif _GRAPHS_BUILD.search(line):
            self.graphs_built = line
        if line.startswith("load_tensors") or " load_tensors:" in line:
            self.loader = True

    def facts(self) -> LogFacts:
        ev, notes = self.ev, []
        offloaded, total, graphs = self.offloaded, self.total, self.graphs
        t0, t1 = self.t_loading, self.t_loaded
        load_s = t1 - t0 if t0 is not None and t1 is not None else None
        if graphs is None and self.graphs_built is not None:
            # compiled in; whether they run is not logged: ggml-cuda's "disabling CUDA graphs" lines are debug
            # builds' only, and GGML_CUDA_DISABLE_GRAPHS turns them off without a word
            graphs, ev["cuda_graphs"] = "compiled in (USE_GRAPHS = 1; their use is not logged)", self.graphs_built
        if not self.loader:
            notes.append(
                "the log has no loader lines (layers offloaded, weights and KV buffers, flash attention): this "
                "llama-server logs them at trace verbosity; start it with -lv 4 to see them"
            )
        elif offloaded is None and self.n_layer is not None:
            offloaded, total = 0, self.n_layer + 1  # no GPU backend: no "offloaded" line; +1 is the output layer
            ev["layers_offloaded"] = "no 'offloaded N/M layers to GPU' line: this build has no GPU backend"
            notes.append("this llama-server has no GPU backend: every layer runs on the CPU")
        if load_s is None and "load_s" in ev:
            notes.append("the log has no timestamps (--log-timestamps): load time not measured from it")
            ev.pop("load_s")
        return LogFacts(
            load_s=load_s,
            weights_bytes=self.gpu_w if self.any_gpu_buf else (0 if self.loader and offloaded == 0 else None),
            weights_host_bytes=self.host_w if self.loader else None,
            layers_offloaded=offloaded,
            layers_total=total,
            kv_cache_bytes=self.kv_bytes,
            kv_cache_tokens=self.kv_tokens,
            kv_cache_type=self.kv_type,
            context=self.ctx,
            slots=self.slots,
            context_per_slot=self.per_slot,
            kv_unified=self.unified,
            flash_attention=self.fa,
            cuda_graphs=graphs,
            devices=tuple(dict.fromkeys(self.devices)),
            evidence=ev,
            notes=tuple(notes),
        )


class LlamaCpp(Dialect):
    kind = "llamacpp"
    health_path = "/health"
    detect_paths = ("/props",)
    ready_paths = ("/health",)
    default_port = 8080

    def launched_by(self, argv: Sequence[str]) -> bool:
        return program(argv).removesuffix(".exe") == "llama-server"

    def parse_log(self, text: str) -> LogFacts:
        scan = _LogScan()
        for line in clean_lines(text):
            scan.read(line)
        return scan.facts()

    async def poll(self, client: httpx.AsyncClient, timeout: float) -> Facts:
        props = await get_json(client, "/props", timeout)
        if not isinstance(props, dict):
            raise PollError("/props is not an object")
        n_ctx = as_int(as_dict(props.get("default_generation_settings")).get("n_ctx"))
        card: dict[str, Any] = {}
        with contextlib.suppress(PollError, httpx.HTTPError):
            card = model_card(await get_json(client, "/v1/models", timeout))
        busy = None
        with contextlib.suppress(PollError, httpx.HTTPError):
            slots = await get_json(client, "/slots", timeout)
            if isinstance(slots, list):
                busy = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing") is True)
                if n_ctx is None and slots and isinstance(slots[0], dict):
                    n_ctx = as_int(slots[0].get("n_ctx"))
        return Facts(
            model=as_str(card.get("id")) or as_str(props.get("model_alias")),
            model_path=as_str(props.get("model_path")),
            context_length=n_ctx,
            slots=as_int(props.get("total_slots")),
            busy_slots=busy,
            quantization=as_str(props.get("model_ftype")) or ftype_name(as_dict(card.get("meta")).get("ftype")),
            build=as_str(props.get("build_info")),
        )

    async def busy(self, client: httpx.AsyncClient, timeout: float) -> int | None:
        # /slots is exact (a slot is processing or not); /metrics (--metrics) adds the deferred queue
        with contextlib.suppress(PollError, httpx.HTTPError):
            slots = await get_json(client, "/slots", timeout)
            if isinstance(slots, list):
                return sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing") is True)
        return await metrics_busy(client, ("llamacpp:requests_processing", "llamacpp:requests_deferred"), timeout)

    async def startup(self, client: httpx.AsyncClient, timeout: float) -> LogFacts:
        try:
            props = await get_json(client, "/props", timeout)
        except (PollError, httpx.HTTPError):
            return LogFacts()
        if not isinstance(props, dict):
            return LogFacts()
        slots = as_int(props.get("total_slots"))
        per_slot = as_int(as_dict(props.get("default_generation_settings")).get("n_ctx"))
        ev = {k: "/props" for k, v in (("slots", slots), ("context_per_slot", per_slot)) if v is not None}
        return LogFacts(slots=slots, context_per_slot=per_slot, evidence=ev)

    async def count_prompt_tokens(
        self, client: httpx.AsyncClient, model: str | None, messages: Sequence[Message]
    ) -> TokenCount:
        msgs = [dict(m) for m in messages]
        try:
            r = await client.post("/v1/chat/completions/input_tokens", json={"model": model, "messages": msgs})
            n = as_int(r.json().get("input_tokens")) if r.status_code == 200 else None
            if n is not None:
                return TokenCount(n, "input_tokens")
            r = await client.post("/apply-template", json={"messages": msgs})
            if r.status_code != 200:
                return TokenCount(None, f"apply-template HTTP {r.status_code}")
            body = {"content": r.json()["prompt"], "add_special": True, "parse_special": True}
            r = await client.post("/tokenize", json=body)
            if r.status_code != 200:
                return TokenCount(None, f"tokenize HTTP {r.status_code}")
            return TokenCount(len(r.json()["tokens"]), "apply-template+tokenize")
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return TokenCount(None, short(exc, 120))

    async def flush_cache(self, client: httpx.AsyncClient) -> str | None:
        try:
            ids = await self._slot_ids(client)
            if not ids:
                return "slot erase: no slots listed"
            for i in ids:
                r = await client.post(f"/slots/{i}", params={"action": "erase"})
                if r.status_code != 200:
                    return f"slot erase HTTP {r.status_code}: {body_message(r)}"
        except (httpx.HTTPError, PollError) as exc:
            return f"slot erase failed: {short(exc, 120)}"
        return f"slot erase HTTP 200 ({len(ids)} slots)"

    async def _slot_ids(self, client: httpx.AsyncClient) -> list[int]:
        with contextlib.suppress(PollError):
            slots = await get_json(client, "/slots", 10.0)
            if isinstance(slots, list):
                return [i for s in slots if isinstance(s, dict) and (i := as_int(s.get("id"))) is not None]
        # --no-slots: /slots answers 501, the slot ids are still 0 .. total_slots-1
        props = await get_json(client, "/props", 10.0)
        return list(range(as_int(as_dict(props).get("total_slots")) or 0))


DIALECT = LlamaCpp()
