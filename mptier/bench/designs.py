"""``--designs`` specs: which designs to compare, and their variants.

A spec is a name and optional ``key=value`` options after colons::

    mptier                 (a) mptier, default pool
    mptier:nice=19         (a) with the workers at CPU priority 19
    mptier:workers=1+1     (a) with one load and one store worker
    mptier:checksum=true   (a) with block checksums on (beside mptier:checksum=false, the
                               run reports their cost, and always the CRC32C speed)
    mptier:uring=false     (a) the C core's system-call loop instead of io_uring
    baseline               (b) the in-process reference: 16+16 threads, pure-Python I/O
    baseline:threads=4+4   (b) with a smaller pool
    pool-native            (c) the reference pool calling mptier.native batch I/O
    raw                    (d) fio when installed, else a plain write/read loop
    raw:tool=loop          (d) the plain loop even when fio is installed
    vllm                   (v) vLLM 0.33's own FileSystemTierManager (where vLLM imports),
                               with its C extension vllm.fs_io_C as every CUDA deployment
                               has it; refuses to run without it (scripts/vllm-env.sh
                               builds it)
    vllm:threads=4+4       (v) with a smaller pool
    vllm-py                (w) vLLM's tier on its Python fallback (per-block os.write /
                               os.readv), the extension switched off for this design alone
    mptier:twin=1          the spec before ``:twin=`` run again under its own label: an
                           A/A control. The two are one design, so how far they differ
                           round by round is how far this run can tell designs apart
                           (the report prints it)

Single letters ``a``, ``b``, ``c``, ``d``, ``v``, ``w`` name the plain designs. Several specs are
separated by commas or spaces (so list CPUs as ``cpus=1+2`` or ``cpus=1-2``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mptier.bench.baseline import NativePoolDesign, ThreadPoolDesign
from mptier.bench.engine import MptierDesign
from mptier.bench.raw import RawLimit
from mptier.bench.vllm_tier import VllmPythonDesign, VllmTierDesign

DESIGNS = {
    "mptier": MptierDesign,
    "baseline": ThreadPoolDesign,
    "pool-native": NativePoolDesign,
    "raw": RawLimit,
    "vllm": VllmTierDesign,
    "vllm-py": VllmPythonDesign,
}
ALIASES = {
    "a": "mptier", "b": "baseline", "c": "pool-native", "d": "raw", "v": "vllm",
    "w": "vllm-py",
    "reference": "baseline", "threads": "baseline", "threads-native": "pool-native",
    "fio": "raw:tool=fio", "raw-loop": "raw:tool=loop",
}
DEFAULT_DESIGNS = "mptier,baseline,pool-native,raw"
# The option naming a twin: the same design again under another label (an A/A control);
# the design itself never sees it.
TWIN_OPTION = "twin"


@dataclass(frozen=True)
class DesignSpec:
    name: str
    options: tuple[tuple[str, str], ...]

    @property
    def label(self) -> str:
        return ":".join([self.name, *(f"{k}={v}" for k, v in self.options)])

    @property
    def twin_of(self) -> DesignSpec | None:
        """The spec this one repeats (without its ``twin`` option), or None."""
        if all(key != TWIN_OPTION for key, _ in self.options):
            return None
        return DesignSpec(self.name, tuple(o for o in self.options if o[0] != TWIN_OPTION))

    def build(self):
        options = {k: v for k, v in self.options if k != TWIN_OPTION}
        return DESIGNS[self.name](self.label, options)


def parse_spec(text: str) -> DesignSpec:
    """Parse one spec; raises ``ValueError`` naming an unknown design or a bad option."""
    text = text.strip()
    head, _, rest = text.partition(":")
    head = head.lower()
    if head in ALIASES:
        alias_head, _, alias_rest = ALIASES[head].partition(":")
        head = alias_head
        rest = ":".join(x for x in (alias_rest, rest) if x)
    if head not in DESIGNS:
        known = ", ".join([*DESIGNS, *ALIASES])
        raise ValueError(f"unknown design {text!r}; known: {known}")
    options = []
    for part in filter(None, rest.split(":")):
        key, eq, value = part.partition("=")
        if not eq or not key or not value:
            raise ValueError(f"design {text!r}: option {part!r} is not KEY=VALUE")
        key, value = key.strip(), value.strip()
        if key == TWIN_OPTION and not (value.isdigit() and int(value) > 0):
            raise ValueError(f"design {text!r}: {TWIN_OPTION}={value} is not a positive "
                             f"count; write e.g. {head}:{TWIN_OPTION}=1")
        options.append((key, value))
    return DesignSpec(head, tuple(options))


def parse_designs(values: list[str] | str) -> list[DesignSpec]:
    """Parse ``--designs`` (repeatable, comma/space separated); duplicates dropped."""
    if isinstance(values, str):
        values = [values]
    specs: list[DesignSpec] = []
    for value in values:
        for token in value.replace(",", " ").split():
            spec = parse_spec(token)
            if spec not in specs:
                specs.append(spec)
    if not specs:
        raise ValueError("--designs names no design")
    for spec in specs:
        if spec.twin_of is not None and spec.twin_of not in specs:
            raise ValueError(f"design {spec.label!r} is a twin of {spec.twin_of.label!r}, "
                             f"which --designs does not name; add {spec.twin_of.label}")
    return specs
