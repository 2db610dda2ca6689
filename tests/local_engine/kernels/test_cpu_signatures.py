"""The ctypes declarations of the native CPU kernels (`library.SIGNATURES`, `DecoderWeights`) against the C source.

ctypes converts arguments by the declared types and never sees the C prototypes: a parameter added in C but not
in Python, or an int64_t declared as an int, corrupts memory instead of raising. These tests parse the exported
prototypes (`unigate_*`, every non-static function), the decoder struct and the weight-format constants of
`kernels.c` and check each against its declaration; the checker is also run on altered copies of the source to
show that it catches a drift.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

import pytest

from local_engine.kernels.cpu import launch
from local_engine.kernels.cpu.library import SIGNATURES, SOURCE, DecoderWeights

C_SCALARS: dict[str, Any] = {
    "int64_t": ctypes.c_int64,
    "int32_t": ctypes.c_int32,
    "int": ctypes.c_int,
    "uint8_t": ctypes.c_uint8,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
}
C_STRUCTS: dict[str, Any] = {"unigate_decoder_t": DecoderWeights}

_PROTOTYPE = re.compile(r"^(?P<ret>[A-Za-z_][\w \t*]*?)\b(?P<name>unigate_\w+)\s*\((?P<params>[^)]*)\)\s*\{", re.M)
_STRUCT = re.compile(r"typedef\s+struct\s*\{(?P<body>[^}]*)\}\s*(?P<name>\w+)\s*;")
_DEFINE = re.compile(r"^#define\s+(WEIGHTS_\w+)\s+(\d+)\s*$", re.M)


def _strip_comments(source: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", source, flags=re.S))


def _c_type(declaration: str) -> tuple[str, int]:
    """`const float *const *` -> ("float", 2): the base type and the pointer depth (qualifiers dropped)."""
    words = [w for w in declaration.replace("*", " ").split() if w not in ("const", "volatile", "restrict")]
    assert len(words) == 1, f"cannot read the C type {declaration!r}"
    return words[0], declaration.count("*")


def _ctypes_matches(declared: Any, base: str, depth: int) -> bool:
    """Whether the ctypes type `declared` passes a C value of type `base` with `depth` pointers."""
    if depth == 0:
        if base == "void":
            return declared is None
        return base in C_SCALARS and declared is C_SCALARS[base]
    if declared is ctypes.c_void_p:
        return depth == 1  # any data pointer; a pointer to pointers is declared as POINTER(c_void_p)
    pointee = getattr(declared, "_type_", None)
    if not (isinstance(declared, type) and issubclass(declared, ctypes._Pointer) and pointee is not None):
        return False
    if depth == 1:
        return pointee is C_STRUCTS.get(base) or (base in C_SCALARS and pointee is C_SCALARS[base])
    return _ctypes_matches(pointee, base, depth - 1)


def exported_prototypes(source: str) -> dict[str, tuple[tuple[str, int], list[tuple[str, int]]]]:
    """name -> (return type, parameter types) of every non-static `unigate_*` function defined in `source`."""
    found = {}
    for match in _PROTOTYPE.finditer(_strip_comments(source)):
        ret = match["ret"].split()
        if "static" in ret:
            continue
        params = [p.strip() for p in match["params"].split(",")]
        types = [] if params == ["void"] else [_c_type(re.sub(r"\b\w+\s*$", "", p)) for p in params]
        found[match["name"]] = (_c_type(match["ret"]), types)
    return found


def struct_fields(source: str, name: str) -> list[tuple[str, tuple[str, int]]]:
    """(field name, (base type, pointer depth)) of `typedef struct {...} name;` in declaration order."""
    for match in _STRUCT.finditer(_strip_comments(source)):
        if match["name"] != name:
            continue
        fields = []
        for declaration in filter(None, (d.strip() for d in match["body"].split(";"))):
            first, *rest = declaration.split(",")
            base_match = re.match(r"^((?:const\s+)?\w+)\s*(.*)$", first.strip())
            assert base_match is not None, declaration
            base = base_match[1]
            for declarator in [base_match[2], *rest]:
                field = re.search(r"(\w+)\s*$", declarator)
                assert field is not None, declaration
                fields.append((field[1], _c_type(f"{base} {declarator[: field.start()]}")))
        return fields
    raise AssertionError(f"no struct {name} in the source")


def signature_problems(source: str, signatures: dict[str, tuple[Any, tuple[Any, ...]]]) -> list[str]:
    """Every disagreement between the C prototypes in `source` and the ctypes `signatures` (empty: they agree)."""
    prototypes = exported_prototypes(source)
    problems = [f"{name}: exported but not declared" for name in sorted(prototypes.keys() - signatures.keys())]
    problems += [f"{name}: declared but not in the C source" for name in sorted(signatures.keys() - prototypes.keys())]
    for name in sorted(prototypes.keys() & signatures.keys()):
        (ret, params), (restype, argtypes) = prototypes[name], signatures[name]
        if not _ctypes_matches(restype, *ret):
            problems.append(f"{name}: returns {ret}, declared {restype}")
        if len(params) != len(argtypes):
            problems.append(f"{name}: {len(params)} parameters in C, {len(argtypes)} declared")
            continue
        for i, (param, declared) in enumerate(zip(params, argtypes, strict=True)):
            if not _ctypes_matches(declared, *param):
                problems.append(f"{name}: parameter {i} is {param} in C, declared {declared}")
    return problems


def struct_problems(source: str) -> list[str]:
    """Every disagreement between the C structs in `source` and their ctypes.Structure (`C_STRUCTS`)."""
    problems = []
    for name, structure in C_STRUCTS.items():
        fields = struct_fields(source, name)
        declared = structure._fields_
        if [f for f, _ in fields] != [f for f, _ in declared]:
            problems.append(f"{name}: fields {[f for f, _ in fields]} in C, {[f for f, _ in declared]} declared")
            continue
        for (field, c_type), (_, ctype) in zip(fields, declared, strict=True):
            if not _ctypes_matches(ctype, *c_type):
                problems.append(f"{name}.{field}: {c_type} in C, declared {ctype}")
    return problems


def test_every_exported_function_is_declared_as_its_prototype() -> None:
    source = SOURCE.read_text()
    assert len(exported_prototypes(source)) == len(SIGNATURES) == 13
    assert signature_problems(source, SIGNATURES) == []


def test_the_decoder_struct_is_declared_as_in_c() -> None:
    assert len(struct_fields(SOURCE.read_text(), "unigate_decoder_t")) == len(DecoderWeights._fields_) == 26
    assert struct_problems(SOURCE.read_text()) == []


def test_the_weight_formats_are_the_c_constants() -> None:
    defines = {name: int(value) for name, value in _DEFINE.findall(SOURCE.read_text())}
    assert defines == {name: getattr(launch, name) for name in ("WEIGHTS_F32", "WEIGHTS_Q4_1", "WEIGHTS_Q8_0")}


PREFILL_TAIL = "int64_t head_dim, int64_t block_size, float scale,"


@pytest.mark.parametrize(
    ("old", "new", "problem"),
    [
        # a float passed where C reads a double, an int64_t where it reads an int, a parameter left out
        (PREFILL_TAIL, PREFILL_TAIL.replace("float scale", "double scale"), "prefill_f32: parameter 14 is ('double'"),
        (PREFILL_TAIL, PREFILL_TAIL.replace("int64_t head_dim", "int head_dim"), "prefill_f32: parameter 12 is ('int'"),
        (PREFILL_TAIL, PREFILL_TAIL.replace("int64_t block_size, ", ""), "prefill_f32: 16 parameters in C, 17"),
        ("unigate_silu_and_mul_f32(float *x,", "unigate_silu_and_mul_f32(float x,", "and_mul_f32: parameter 0"),
        ("int unigate_linear_f32(", "void unigate_linear_f32(", "unigate_linear_f32: returns ('void', 0)"),
        ("int64_t unigate_vector_lanes(void)", "int unigate_vector_lanes(void)", "unigate_vector_lanes: returns"),
        ("int64_t unigate_vector_lanes(void)", "int64_t unigate_vector_width(void)", "width: exported but not"),
        ("unigate_cpu_kernels_limits(int64_t *heads,", "unigate_cpu_kernels_limits(int32_t *heads,", "parameter 0"),
        ("unigate_decode_layers_f32(const unigate_decoder_t *m", "unigate_decode_layers_f32(float *m", "parameter 0"),
    ],
)
def test_a_prototype_that_drifted_from_its_declaration_is_caught(old: str, new: str, problem: str) -> None:
    source = SOURCE.read_text()
    assert source.count(old) == 1
    problems = signature_problems(source.replace(old, new), SIGNATURES)
    assert any(problem in p for p in problems), problems


def test_a_static_helper_needs_no_declaration_and_a_new_export_does() -> None:
    source = SOURCE.read_text()
    static = "static int64_t unigate_helper(const float *x) {\n    return 0;\n}\n"
    assert signature_problems(source + static, SIGNATURES) == []
    assert signature_problems(source + static.removeprefix("static "), SIGNATURES) == [
        "unigate_helper: exported but not declared"
    ]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("int64_t weight_format;", "int weight_format;"),  # a narrower field shifts every one after it
        ("float eps, scale;", "float eps, scale, temperature;"),
        ("const float *final_norm, *cos_sin;", "const float *const *final_norm, *cos_sin;"),
    ],
)
def test_a_struct_that_drifted_from_its_declaration_is_caught(old: str, new: str) -> None:
    source = SOURCE.read_text()
    assert source.count(old) == 1
    assert struct_problems(source.replace(old, new)) != []
