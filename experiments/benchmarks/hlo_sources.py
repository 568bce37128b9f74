"""Where a profiled XLA kernel's work comes from: the source lines of the ops it runs, read from XLA's optimized HLO.

Why: a profile names XLA's kernels after their fusions ("loop_add_fusion_9", "input_reduce_fusion_6"), which says
nothing about which line of the model or the loss they compute. XLA's optimized HLO (`--xla_dump_to=DIR
--xla_dump_hlo_as_text`: DIR/module_<id>.<name>.<...>after_optimizations.txt, or `compiled.as_text()`) holds every
fusion with the computation it calls, and every instruction carries JAX's metadata: `op_name` (the jaxpr path, e.g.
"jit(_update)/transpose(jvp(...))/mul": "transpose(jvp" marks the backward) and `source_file` / `source_line` (the
user frame that traced it). `module_sources` maps each instruction of a module to the source lines of what it
runs (a fusion: the instructions of its computation, weighted by their output bytes); `attribute` adds them to
step_profile's top kernels and sums kernel time by dominant source line. JAX gives the ops of a custom_vjp's backward
the source line of the custom_vjp's call (e.g. ops/grouped.py's `_grouped(...)`): their op_name, which says
"transpose(jvp(...))", is then the better hint.
"""

from __future__ import annotations

import collections
import glob
import os
import re

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1, "s16": 2,
                "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")  # at column 0; instructions are indented
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_SOURCE = re.compile(r'source_file="([^"]+)"\s+source_line=(\d+)')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SHAPE = re.compile(r"(\w+)\[([\d,]*)\]")
_ROOTS = ("src/", "pallas_kernels/", "experiments/", "tests/")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string ("f32[4,128]{1,0}", or a tuple of them)."""
    total = 0
    for dtype, dims in _SHAPE.findall(shape):
        if dtype in _DTYPE_BYTES:
            n = 1
            for d in dims.split(","):
                n *= int(d) if d else 1
            total += n * _DTYPE_BYTES[dtype]
    return total


def short_source(path: str, line: str | int) -> str:
    """"<repo-relative path>:<line>" (the part from src/, pallas_kernels/, ... on; else the file name)."""
    for root in _ROOTS:
        i = path.rfind(root)
        if i >= 0:
            return f"{path[i + (4 if root == 'src/' else 0):]}:{line}"
    return f"{os.path.basename(path)}:{line}"


def normalize(name: str) -> str:
    """A kernel / instruction name with '.' and '-' as '_': how XLA names a fusion's GPU kernel after it."""
    return name.replace(".", "_").replace("-", "_")


def _frames(text: str) -> dict[str, str]:
    """stack_frame_id -> "<path>:<line> <function>" of the frame's own location (the innermost user frame of an op),
    from the FileNames / FunctionNames / FileLocations / StackFrames tables newer XLA prints before the computations
    (older dumps put source_file / source_line in each instruction's metadata instead)."""
    tables: dict[str, dict[str, str]] = {}
    section = None
    for line in text.splitlines():
        if line.strip() in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line.strip()
            tables[section] = {}
            continue
        if section is None:
            continue
        row = _TABLE_ROW.match(line.strip())
        if not row:
            if line.strip():
                section = None
            continue
        tables[section][row.group(1)] = row.group(2)
    files = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    locations = {}
    for k, v in tables.get("FileLocations", {}).items():
        f = dict(_FIELD.findall(v))
        locations[k] = f"{short_source(files.get(f.get('file_name_id'), '?'), f.get('line', '?'))} {funcs.get(f.get('function_name_id'), '')}".strip()
    return {k: locations.get(dict(_FIELD.findall(v)).get("file_location_id"), "?") for k, v in tables.get("StackFrames", {}).items()}


def _source(line: str, frames: dict[str, str]) -> str | None:
    src = _SOURCE.search(line)
    if src:
        return short_source(*src.groups())
    frame = _FRAME_ID.search(line)
    return frames.get(frame.group(1)) if frame else None


def _parse(text: str):
    """(computations: name -> [(instruction, opcode, bytes, source or None, op_name)], instructions: name ->
    (computation, opcode, bytes, source, op_name, called computation or None))."""
    frames = _frames(text)
    computations: dict[str, list] = {}
    instructions: dict[str, tuple] = {}
    current = None
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            name, shape, opcode = m.groups()
            src = _source(line, frames)
            opn = _OP_NAME.search(line)
            calls = _CALLS.search(line)
            entry = (name, opcode, shape_bytes(shape), src, opn.group(1) if opn else "")
            computations[current].append(entry)
            instructions[name] = (current, opcode, entry[2], entry[3], entry[4], calls.group(1) if calls else None)
            continue
        c = _COMPUTATION.match(line)
        if c:
            current = c.group(1)
            computations.setdefault(current, [])
        elif line.strip() == "}":
            current = None
    return computations, instructions


def module_sources(text: str, top: int = 3) -> dict[str, dict]:
    """For every instruction of an optimized HLO module: {"sources": [(source, share of the output bytes)], "op_name":
    the op_name of its largest op, "backward": whether that op is a transpose (backward) op}. A fusion's sources are
    those of the instructions of its computation (and nested fusions), by output bytes; another instruction's are
    its own. Keyed by the instruction name and by its `normalize`d form (the GPU kernel name)."""
    computations, instructions = _parse(text)

    def ops_of(comp: str, seen: frozenset = frozenset()) -> list:
        out = []
        for name, opcode, nbytes, src, opn in computations.get(comp, ()):
            called = instructions.get(name, (None,) * 6)[5]
            if opcode == "fusion" and called and called not in seen:
                out.extend(ops_of(called, seen | {called}))
            elif opcode != "parameter":
                out.append((nbytes, src, opn))
        return out

    result = {}
    for name, (_, opcode, nbytes, src, opn, called) in instructions.items():
        ops = ops_of(called) if opcode == "fusion" and called else [(nbytes, src, opn)]
        weights: collections.Counter = collections.Counter()
        biggest = (-1, "")
        for b, s, o in ops:
            if s:
                weights[s] += max(b, 1)
            if o and b > biggest[0]:
                biggest = (b, o)
        total = sum(weights.values())
        info = {"sources": [(s, w / total) for s, w in weights.most_common(top)] if total else [],
                "op_name": biggest[1] or opn, "backward": "transpose(" in (biggest[1] or opn)}
        result[name] = info
        result.setdefault(normalize(name), info)
    return result


def dump_files(dump_dir: str, module: str) -> list[str]:
    """The after-optimizations text dumps of modules whose name contains `module`, newest last."""
    files = glob.glob(os.path.join(dump_dir, "*after_optimizations.txt"))
    return sorted((f for f in files if module in os.path.basename(f)), key=os.path.getmtime)


def best_module(files: list[str], kernel_names: list[str]) -> tuple[str | None, dict]:
    """The dump (and its `module_sources`) that names the most of `kernel_names` (a profile's kernels of one
    program: two recipes compile two modules of one name whose fusions are numbered differently); ties: the newest."""
    best, best_map, best_hits = None, {}, -1
    for f in files:
        with open(f) as fh:
            mapping = module_sources(fh.read())
        hits = sum(1 for k in kernel_names if k in mapping)
        if hits >= best_hits:
            best, best_map, best_hits = f, mapping, hits
    return best, best_map


def attribute(per_step: dict, mapping: dict) -> dict:
    """Add "sources" / "op_name" / "backward" to `per_step["top_kernels"]` entries found in `mapping` (by kernel name,
    else by their hlo_op), and return {"by_source": ms per dominant source line, largest first, "attributed_ms",
    "unattributed_ms"} over those top kernels."""
    by_source: collections.Counter = collections.Counter()
    attributed = unattributed = 0.0
    for entry in per_step.get("top_kernels", []):
        info = mapping.get(entry["name"]) or mapping.get(normalize(entry["name"]))
        if info is None and entry.get("hlo_op"):
            info = mapping.get(entry["hlo_op"]) or mapping.get(normalize(entry["hlo_op"]))
        if info is None or not info["sources"]:
            unattributed += entry["ms"]
            continue
        entry["sources"] = [f"{s} ({share:.0%})" for s, share in info["sources"]]
        entry["op_name"] = info["op_name"][-160:]
        entry["backward"] = info["backward"]
        by_source[info["sources"][0][0]] += entry["ms"]
        attributed += entry["ms"]
    return {"by_source": [{"source": s, "ms": ms} for s, ms in by_source.most_common()],
            "attributed_ms": attributed, "unattributed_ms": unattributed}
