"""The 27B plan's arms (issue 37), read from scripts/gpu/plan27b.sh as the orchestrator sources it: the arms a
switch uses first (SGLang and vLLM in FP8), the extras and their cut order, the GGUF arm by one flag, vLLM's
command with its share left to ``bench --launch`` (fitted to the budget like SGLang's), and live.py's traffic
profile parsing."""

from __future__ import annotations

import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.procs.launch import fit_memory_share

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "scripts" / "gpu"
H200_MIB = 143771


def plan(expr: str, **env: str) -> str:
    e = {k: v for k, v in os.environ.items() if k not in ("SMOKE", "ARMS", "EXTRAS", "GGUF")}
    r = subprocess.run(["bash", "-c", f". scripts/gpu/plan27b.sh && {expr}"], cwd=ROOT, env={**e, **env},
                       capture_output=True, text=True, check=True)  # fmt: skip
    return r.stdout.strip()


def test_the_core_arms_and_the_cut_order() -> None:
    assert plan('echo "$ARMS|$EXTRAS"') == "sg_fp8 vllm_fp8|tune diag sg_bf16 sg_gguf"
    # the same-file arm by one flag: into the core, out of the extras
    arms, extras = plan('echo "$ARMS|$EXTRAS"', GGUF="1").split("|")
    assert arms == "sg_fp8 vllm_fp8 sg_gguf" and "sg_gguf" not in extras.split()


def test_the_orchestrator_runs_arms_then_bench_live_join_then_extras() -> None:
    text = (GPU / "orchestrate.sh").read_text()
    lane = text[text.index("gpu_lane() {") :]
    lane = lane[: lane.index("\n}\n")]
    order = [w for w in ("$ARMS", "step_bench", "step_live", "step_join", "$EXTRAS") if w in lane]
    assert order == ["$ARMS", "step_bench", "step_live", "step_join", "$EXTRAS"]
    assert lane.index("$EXTRAS") > lane.index("step_join") and lane.rstrip().endswith("step_join")


def test_tune_is_16_against_64_slots_at_c64_with_5_repeats() -> None:
    np_, workload = plan('echo "$TUNE_NP|$TUNE_WORKLOAD"').split("|")
    assert np_ == "16,64"
    assert "--concurrency 64 " in workload and "--repeats 5" in workload


def test_sglang_fp8_is_the_dummy_weights_quantized() -> None:
    cmd = plan("sg_fp8_cmd")
    assert "--load-format dummy" in cmd and "--quantization fp8" in cmd and "--mem-fraction-static 0.479" in cmd


def test_vllm_fp8_leaves_its_share_to_the_bench_which_fits_it_to_the_budget() -> None:
    cmd = plan("vllm_fp8_cmd")
    argv = shlex.split(cmd)
    assert "--gpu-memory-utilization" not in argv
    for flag, value in (("--quantization", "fp8"), ("--load-format", "dummy"), ("--max-model-len", "196608"),
                        ("--max-num-seqs", "64"), ("--served-model-name", "m27b")):  # fmt: skip
        assert argv[argv.index(flag) + 1] == value, flag
    launch = " ".join(w for w in argv if "=" not in w or w.startswith("--")).replace("{port}", "8000")
    fitted, note = fit_memory_share("vllm-fp8", launch, 72 * 2**30, H200_MIB * 2**20)
    share = float(shlex.split(fitted)[-1])
    assert shlex.split(fitted)[-2] == "--gpu-memory-utilization" and note
    assert share == pytest.approx((72 - 1) * 1024 / H200_MIB, abs=0.001)  # vLLM's share bounds all but ~1 GiB
    # the retry's context: a smaller --max-model-len, the rest as it was
    assert "--max-model-len 131072" in plan("vllm_fp8_cmd 131072")


def test_the_smoke_swaps_in_the_emulators() -> None:
    env = {"SMOKE": "1", "LLAMA_SERVER_BIN": "/bin/true", "SMOKE_BACKEND_PORT": "9"}
    assert "fakes.sglang_emulator" in plan("sg_fp8_cmd", **env) and "--quantization fp8" in plan("sg_fp8_cmd", **env)
    vl = plan("vllm_fp8_cmd", **env)
    assert "fakes.vllm_emulator" in vl and "--emulate-fixed-gib 70.2" in vl and "--max-model-len 4096" in vl
    assert plan('echo "[$EXTRAS]"', **env) == "[]"


def _live() -> object:
    spec = importlib.util.spec_from_file_location("live_under_test", GPU / "live.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["live_under_test"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_live_profile_and_the_traffic_spec() -> None:
    live = _live()
    assert live.parse_profile("1:15,2:10,32:15,1:10,64:20,2:10,8:15")[4] == (64, 20.0)  # type: ignore[attr-defined]
    with pytest.raises(ValueError):
        live.parse_profile("64")  # type: ignore[attr-defined]
    line = "INFO traffic served: c=1 50%; to weigh a bench's answer by it: --traffic c1=50,c64=50\n"
    assert live.traffic_spec(line, None) == ("c1=50,c64=50", "serve's shutdown line")  # type: ignore[attr-defined]
    spec, source = live.traffic_spec("", {"traffic": {"busy_shares": {"1": 0.25, "33-64": 0.75}}})  # type: ignore[attr-defined]
    assert source.startswith("/health") and spec.startswith("c1=25,c")


def _retry(log: str, tmp_path: Path, mode: str = "auto") -> tuple[str, str]:
    """orchestrate.sh's vl_retry_target on an engine log, as the plan runs it (H200 card, 72 GiB budget)."""
    (tmp_path / "engines").mkdir(parents=True)
    (tmp_path / "engines" / "vllm-fp8.log").write_text(log)
    text = (GPU / "orchestrate.sh").read_text()
    fn = text[text.index("vl_retry_target() {") :]
    fn = fn[: fn.index("\n}\n") + 3]
    script = f". scripts/gpu/plan27b.sh\nGPU_TOTAL_MIB={H200_MIB}\nVL_RETRY={mode}\n{fn}\nvl_retry_target {tmp_path}"
    r = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=False,
                       env={k: v for k, v in os.environ.items() if k != "SMOKE"})  # fmt: skip
    assert r.returncode == 0, r.stderr
    target, why = r.stdout.rstrip("\n").split("\t")
    return target, why


# vLLM 0.26.0's own words (vllm/v1/core/kv_cache_utils.py), with numbers of a 27B FP8 start at the 0.505 share
REFUSAL = ("ValueError: To serve at least one request with the model's max seq len (196608), ({need} GiB KV cache is "
           "needed, which is larger than the available KV cache memory ({have} GiB). Based on the available memory, "
           "the estimated maximum model length is {est}. Try increasing `gpu_memory_utilization` (which also "
           "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine.")  # fmt: skip


def test_vllm_retry_raises_the_share_when_the_budget_has_room(tmp_path: Path) -> None:
    target, why = _retry(REFUSAL.format(need=43.5, have=43.3, est=195700), tmp_path)
    assert "--gpu-memory-utilization 0.509" in target and "--max-model-len 196608" in target
    assert why.startswith("VL_RETRY=auto -> share")


def test_vllm_retry_lowers_the_context_when_the_share_would_pass_the_budget(tmp_path: Path) -> None:
    target, why = _retry(REFUSAL.format(need=43.5, have=41.2, est=186000), tmp_path)
    assert "--max-model-len 185344" in target and "--gpu-memory-utilization" not in target  # 181 x 1024
    assert why.startswith("VL_RETRY=auto -> ctx")
    target, _ = _retry(REFUSAL.format(need=43.5, have=41.2, est=186000), tmp_path / "x", "share")
    assert "--gpu-memory-utilization 0.512" in target  # forced: capped at the budget's share of the card
