"""The engine's compute form (dtype and batch invariance) where the options leave it to the
engine: chosen by timing each candidate on this machine, not read from CPU flags.

Flags do not say which is faster. A hypervisor hides AMX; oneDNN's bf16 kernels on an Intel
Xeon without AMX run at half its float32 rate, on a Zen 4 at twice it; the row-invariant
kernels cost nothing on one class and a quarter of a prefill on another. So each candidate
form is timed at start (worker/compute_probe.py) on the model's own shapes, and the timings are
cached on disk, keyed by everything that decides them: the CPU, its flags, torch and oneDNN,
the native kernels' instruction set, the threads and the model's shapes.

The rules, in order:
- `batch_invariant="auto"`: on in a dtype where it costs at most `INVARIANCE_MAX_COST` of that
  dtype's prefill and of its decode step; off otherwise. True or False are kept whatever the cost.
- `dtype="auto"`: the dtype whose prefill (its chosen invariance) is fastest, float32 unless
  another is faster by more than `NARROWER_DTYPE_MIN_GAIN`: float32 is the reference's own
  arithmetic, and a narrower dtype must pay for the rounding it brings clearly, not by noise.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from firsttoken.ops.cpu_info import cpu_flags, cpu_model_name
from firsttoken.worker.cpu_contention import measured_for_cache

logger = logging.getLogger(__name__)

CHOICE_VERSION = 1
# Batch invariance is kept on by `auto` where it slows the prefill and the decode step by at most this.
INVARIANCE_MAX_COST = 0.05
# A dtype narrower than float32 is chosen by `auto` only where its prefill is faster by more than this.
NARROWER_DTYPE_MIN_GAIN = 0.10
FLOAT32 = "float32"
BFLOAT16 = "bfloat16"


@dataclass(frozen=True)
class ComputeForm:
    """A candidate: the dtype the model computes in and whether its kernels keep batch invariance."""

    dtype: str
    batch_invariant: bool

    @property
    def label(self) -> str:
        return f"{self.dtype}, invariance {'on' if self.batch_invariant else 'off'}"


@dataclass(frozen=True)
class FormTiming:
    """A form's measured cost, extrapolated to the whole model: a prefill of `prefill_tokens`
    tokens and a one-row decode step after it."""

    form: ComputeForm
    prefill_s: float
    decode_s: float


@dataclass(frozen=True)
class ComputeRequest:
    """What the options ask: a dtype name ("auto" or one) and True, False or "auto" for invariance."""

    dtype: str
    batch_invariant: bool | str

    @property
    def measures(self) -> bool:
        return self.dtype == "auto" or self.batch_invariant == "auto"


@dataclass(frozen=True)
class ComputeChoice:
    """The form the engine runs, the timings behind it, and why, a line each for the start-up log."""

    dtype: str
    batch_invariant: bool
    prefill_tokens: int
    timings: tuple[FormTiming, ...]
    dtype_reason: str
    invariance_reason: str

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ComputeChoice:
        timings = tuple(
            FormTiming(ComputeForm(**timing["form"]), timing["prefill_s"], timing["decode_s"])
            for timing in data["timings"]
        )
        return cls(**{**data, "timings": timings})


def candidate_forms(request: ComputeRequest, bf16_kernels: bool) -> list[ComputeForm]:
    """The forms the request leaves open: bf16 only where oneDNN has bf16 kernels (elsewhere a
    bf16 projection widens to float32 and cannot be faster than float32 itself)."""
    if request.dtype == "auto":
        dtypes = [FLOAT32, BFLOAT16] if bf16_kernels else [FLOAT32]
    else:
        dtypes = [request.dtype]
    invariances = [True, False] if request.batch_invariant == "auto" else [bool(request.batch_invariant)]
    return [ComputeForm(dtype, invariant) for dtype in dtypes for invariant in invariances]


def choose_form(request: ComputeRequest, timings: list[FormTiming], prefill_tokens: int) -> ComputeChoice:
    """The form the rules pick among measured `timings` (one per candidate form of `request`)."""
    by_form = {timing.form: timing for timing in timings}
    dtypes = list(dict.fromkeys(timing.form.dtype for timing in timings))
    kept: dict[str, FormTiming] = {}
    invariance_reasons: dict[str, str] = {}
    for dtype in dtypes:
        kept[dtype], invariance_reasons[dtype] = _invariance_of(request, by_form, dtype)
    dtype, dtype_reason = _dtype_of(request, kept, prefill_tokens)
    return ComputeChoice(
        dtype=dtype,
        batch_invariant=kept[dtype].form.batch_invariant,
        prefill_tokens=prefill_tokens,
        timings=tuple(timings),
        dtype_reason=dtype_reason,
        invariance_reason=invariance_reasons[dtype],
    )


def invariance_cost(on: FormTiming, off: FormTiming) -> float:
    """What invariance adds to the more slowed of prefill and decode, as a fraction (negative:
    invariance is faster)."""
    return max(on.prefill_s / off.prefill_s, on.decode_s / off.decode_s) - 1.0


def _invariance_of(
    request: ComputeRequest, by_form: dict[ComputeForm, FormTiming], dtype: str
) -> tuple[FormTiming, str]:
    if request.batch_invariant != "auto":
        timing = by_form[ComputeForm(dtype, bool(request.batch_invariant))]
        state = "on" if timing.form.batch_invariant else "off"
        return timing, f"batch invariance {state}, as asked"
    on, off = by_form[ComputeForm(dtype, True)], by_form[ComputeForm(dtype, False)]
    cost = invariance_cost(on, off)
    measured = (
        f"prefill {_ms(on.prefill_s)} vs {_ms(off.prefill_s)} ms, decode step {_ms(on.decode_s)} vs "
        f"{_ms(off.decode_s)} ms"
    )
    if cost <= INVARIANCE_MAX_COST:
        return on, (
            f"batch invariance auto: on, as it costs {cost:+.0%} here (at most {INVARIANCE_MAX_COST:.0%}; "
            f"{measured})"
        )
    return off, (
        f"batch invariance auto: off, as it costs {cost:+.0%} here (over {INVARIANCE_MAX_COST:.0%}; "
        f"{measured}); batch_invariant=True keeps it whatever the cost"
    )


def _dtype_of(request: ComputeRequest, kept: dict[str, FormTiming], prefill_tokens: int) -> tuple[str, str]:
    if request.dtype != "auto":
        return request.dtype, f"dtype {request.dtype}, as asked"
    fastest = min(kept.values(), key=lambda timing: timing.prefill_s)
    reference = kept[FLOAT32]
    gain = 1.0 - fastest.prefill_s / reference.prefill_s
    chosen = fastest if gain > NARROWER_DTYPE_MIN_GAIN else reference
    figures = "; ".join(
        f"{dtype}: {_ms(timing.prefill_s)} ms per {prefill_tokens}-token prefill, {_ms(timing.decode_s)} ms "
        f"per decode step"
        for dtype, timing in kept.items()
    )
    if len(kept) == 1:
        return FLOAT32, f"dtype auto: float32, as oneDNN has no bf16 kernels for this CPU ({figures})"
    if chosen.form.dtype == FLOAT32:
        why = f"no narrower dtype prefills more than {NARROWER_DTYPE_MIN_GAIN:.0%} faster here"
    else:
        why = f"it prefills {gain:.0%} faster than float32 here"
    return chosen.form.dtype, f"dtype auto: {chosen.form.dtype}, as {why} ({figures}; measured at start)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


@dataclass(frozen=True)
class ChoiceKey:
    """Everything the timings depend on; a cached choice is reused only when all of it matches."""

    cpu: str
    flags_digest: str
    torch_version: str
    onednn_version: str
    onednn_max_isa: str
    native_isa: str
    threads: int
    shapes: str
    request: str

    def file_name(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:24]
        return f"v{CHOICE_VERSION}-{digest}.json"


def choice_key(native_isa: str, threads: int, shapes: str, request: ComputeRequest) -> ChoiceKey:
    """The key of this machine, software, model shapes and request."""
    flags = " ".join(sorted(cpu_flags()))
    return ChoiceKey(
        cpu=cpu_model_name(),
        flags_digest=hashlib.sha256(flags.encode()).hexdigest()[:16],
        torch_version=torch.__version__,
        onednn_version=_onednn_version(),
        onednn_max_isa=os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        native_isa=native_isa,
        threads=threads,
        shapes=shapes,
        request=f"{request.dtype}/{request.batch_invariant}",
    )


def load_or_choose(
    cache_folder: str,
    key: ChoiceKey,
    request: ComputeRequest,
    measure: Callable[[], tuple[list[FormTiming], int]],
    read_stat: Callable[[], str | None] | None = None,
) -> tuple[ComputeChoice, bool]:
    """The cached choice for `key`, else one made from `measure()` (the timings and the prefill
    length they were taken at) and cached unless other work disturbed the timings (`read_stat`:
    the machine's CPU times); and whether it came from the cache."""
    path = os.path.join(cache_folder, key.file_name())
    cached = read_cached(path, key)
    if cached is not None:
        try:
            return ComputeChoice.from_json(cached), True
        except (KeyError, TypeError, ValueError) as error:
            logger.warning("ignoring the cached compute choice %s (%s); measuring again", path, error)
    measured, cacheable = measured_for_cache("the compute forms' timings", measure, key.threads, read_stat)
    timings, prefill_tokens = measured
    choice = choose_form(request, timings, prefill_tokens)
    if cacheable:
        write_cached(path, key, choice.to_json())
    return choice, False


def read_cached(path: str, key: ChoiceKey) -> dict | None:
    """What `write_cached` wrote at `path` for `key`; None where nothing is, the key differs or
    the file does not read (said in the log)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        if data.get("key") != asdict(key):
            return None
        return data["choice"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        if not isinstance(error, FileNotFoundError):
            logger.warning("ignoring the cached measurement %s (%s); measuring again", path, error)
        return None


def write_cached(path: str, key: ChoiceKey, choice: dict) -> None:
    """`choice` (plain JSON data) with its key at `path`, replaced whole: a reader never sees half."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump({"key": asdict(key), "choice": choice}, handle, indent=1)
    os.replace(temporary, path)


def _onednn_version() -> str:
    """oneDNN's version as torch's build report names it (torch has no call for it)."""
    match = re.search(r"MKL-DNN v([0-9.]+)", torch.__config__.show())
    return match.group(1) if match else "none"
