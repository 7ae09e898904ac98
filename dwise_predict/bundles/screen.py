"""Screen a bundle before anything deserialises it: which files it may hold, and what each may hold.

Everything in a bundle may come from an attacker, who can also reseal ``bundle.json``: its hashes
prove that the files are the ones the manifest names, not who wrote the manifest. So every reader
(``verify`` and its probe worker, ``publish``, ``zoo pull``, the serving loader, ``simulate
--bundle``, ``serve``) goes through this module, and it refuses, naming the file and the reason:

- any name but the known artifacts (:data:`~dwise_predict.bundles.manifest.BUNDLE_ARTIFACTS`), a
  symbolic link, a directory or a device (:func:`check_layout`, before a byte is read);
- declared shapes that the artifacts do not have (``hidden_size``, ``in_features``, ``K``, the
  ONNX graphs' inputs, the safetensors tensors, the probes), NaN or non-monotone calibration knots,
  JSON nested or sized past what we write;
- ONNX tensors stored outside the file (external data: a path onnxruntime would open), and graphs
  whose run is not bounded by the declared sizes (:mod:`dwise_predict.bundles.graph_bounds`: loops,
  allocations from a tensor's values, constants past the weights, a batch times a batch);
- a safetensors tensor whose data span is not what its dtype and shape need;
- in ``refine.pt`` (TorchScript) and ``refine.pt2`` (torch.export), both zip archives of pickles
  and code: any member our exporter does not write, any pickle global outside a short allowlist
  (read with :mod:`pickletools`, which executes nothing), weights or constants marked pickled,
  TorchScript code or graph nodes calling anything but tensor arithmetic (``aten::save`` writes a
  file, ``aten::from_file`` maps one), and any text that torch would evaluate (a torch.export
  program's symbolic shapes go through ``sympy.sympify``, its guards are compiled as Python) beyond
  the narrow grammar our exports use;
- a LightGBM text model past its limits (:mod:`dwise_predict.admission.model_text`).

Loaders read a file once with :func:`read_checked` (size, sha256 and content screen on the bytes
they then deserialise, so nothing can change in between). Standard library at module level (the
serving side imports this); ``onnx`` parses a graph's protobuf when one is checked, never runs it.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickletools
import re
import stat
import struct
import tokenize
import zipfile
from pathlib import Path

from dwise_predict.errors import BundleError
from dwise_predict.bundles.manifest import (
    BUNDLE_ARTIFACTS,
    BUNDLE_FILE,
    FIX,
    PROBES_FILE,
    REQUIRED_ARTIFACTS,
    SIGNAL_COUNT,
    BundleManifest,
    check_files,
    printable,
    read_bundle_manifest,
)
from dwise_predict.bundles.graph_bounds import ADMISSION_OPS, REFINE_OPS, SLACK, check_graph_bounds, row_budget
from dwise_predict.files import loads_json
from dwise_predict.names import HIDDEN_STATES

MAX_KNOTS = 1 << 20
MAX_PROBES = 100_000
MAX_MEMBERS = 4096  # members of one zip archive (ours: ~20)
MAX_READ = 64 << 20  # a pickle, code or JSON member of an archive, or a text artifact (ours: < 1 MB)
TEXT_ARTIFACTS = ("calibration.json", "admission.txt")
SAFETENSORS_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                          "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
ADMISSION_ROW_NUMBERS = 64  # per request: 3 features in, one estimate out

# --- pickles ------------------------------------------------------------------------------------

# Globals our exports' pickles name (scanned from TorchScript's data.pkl / constants.pkl /
# *.debug_pkl and torch.export's sample inputs): the tensor rebuild, its storages, an ordered dict,
# TorchScript's list builders and our own scripted class. Nothing else may be named.
_STORAGES = r"torch (?:Float|Double|Half|BFloat16|Long|Int|Short|Char|Byte|Bool)Storage"
TENSOR_GLOBALS = re.compile(rf"torch\._utils _rebuild_tensor_v2|collections OrderedDict|{_STORAGES}")
TORCHSCRIPT_GLOBALS = re.compile(
    rf"{TENSOR_GLOBALS.pattern}|torch\.jit\._pickle build_(?:intlist|doublelist|boollist|tensorlist)"
    r"|__torch__\.dwise_predict(?:\.\w+)+ \w+")
_STRING_PUSHES = {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE",
                  "BINUNICODE8"}
_STACK_NEUTRAL = {"PROTO", "FRAME", "PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"}


def pickle_globals(data: bytes, where: str) -> list[str]:
    """Every global (``"module name"``) a pickle would import, read with :func:`pickletools.genops`,
    which decodes opcodes and executes nothing.

    ``STACK_GLOBAL`` takes its two names from the stack; they must have been pushed as string
    literals right before it (directly or through the memo), else the global is unknowable
    statically and the pickle is refused. The copyreg extension registry (``EXT*``) is refused too.
    """
    found: list[str] = []
    recent: list[str | None] = []  # what the latest pushes put on the stack (None: not a literal string)
    memo: dict[int, str | None] = {}
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in _STRING_PUSHES:
                recent.append(arg if isinstance(arg, str) else None)
            elif name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
                memo[len(memo) if name == "MEMOIZE" else arg] = recent[-1] if recent else None
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(arg))
            elif name in ("GLOBAL", "INST"):
                found.append(arg)
                recent = []
            elif name == "STACK_GLOBAL":
                if len(recent) < 2 or not all(isinstance(s, str) for s in recent[-2:]):
                    raise BundleError(f"{where} holds a pickle whose STACK_GLOBAL names a computed global: refusing "
                                      f"to load it; {FIX}")
                found.append(f"{recent[-2]} {recent[-1]}")
                recent = []
            elif name.startswith("EXT"):
                raise BundleError(f"{where} holds a pickle that imports through the copyreg registry ({name}): "
                                  f"refusing to load it; {FIX}")
            elif name not in _STACK_NEUTRAL:
                recent = []
    except ValueError as err:  # pickletools' word for a malformed or truncated pickle
        raise BundleError(f"{where} holds a malformed pickle ({err}): refusing to load it; {FIX}") from None
    return found


def check_pickle(data: bytes, where: str, allowed: re.Pattern) -> None:
    """Refuse a pickle naming any global that ``allowed`` does not fullmatch."""
    for name in pickle_globals(data, where):
        if not allowed.fullmatch(name):
            raise BundleError(f"{where} holds a pickle that would import {printable(name)}, which no dwise-predict "
                              f"export pickles (unpickling it could run code): refusing to load it; {FIX}")


# --- zip archives (TorchScript, torch.export) ------------------------------------------------------

_TENSOR_DATA = re.compile(r"/data/\d+$|/constants/\d+$|/weight_\d+$|/tensor_\d+$")


def _archive(data: bytes, where: str, members: re.Pattern) -> zipfile.ZipFile:
    """``data`` as a zip whose every member name fullmatches ``members`` (group ``root``: one
    directory shared by all), unencrypted, stored or deflated, each named once."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
        raise BundleError(f"{where} is not a readable zip archive ({err}): {FIX}") from None
    if len(infos) > MAX_MEMBERS:
        raise BundleError(f"{where} holds {len(infos):,} archive members, more than any export writes: {FIX}")
    roots, names = set(), set()
    for info in infos:
        match = members.fullmatch(info.filename)
        if match is None:
            raise BundleError(f"{where} holds the archive member {printable(info.filename)}, which our exporter never "
                              f"writes: refusing to load it; {FIX}")
        if info.filename in names:
            raise BundleError(f"{where} holds the archive member {printable(info.filename)} twice: refusing to load it; "
                              f"{FIX}")
        # tensor data is stored as is (torch maps it): only then is its size bounded by the archive's
        compression = (zipfile.ZIP_STORED,) if _TENSOR_DATA.search(info.filename) else (zipfile.ZIP_STORED,
                                                                                         zipfile.ZIP_DEFLATED)
        if info.flag_bits & 0x1 or info.compress_type not in compression:
            raise BundleError(f"{where}: archive member {printable(info.filename)} is encrypted or compressed in a way "
                              f"our exporter never uses: {FIX}")
        names.add(info.filename)
        roots.add(match.group("root"))
    if len(roots) > 1:
        raise BundleError(f"{where} spreads its members over several roots ({', '.join(sorted(roots))}): {FIX}")
    return archive


def _read(archive: zipfile.ZipFile, name: str, where: str) -> bytes:
    """One member, refused when it inflates past :data:`MAX_READ` (a zip bomb) or fails its CRC."""
    try:
        with archive.open(name) as member:
            data = member.read(MAX_READ + 1)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, RuntimeError) as err:
        raise BundleError(f"{where}: archive member {printable(name)} is unreadable ({err}): {FIX}") from None
    if len(data) > MAX_READ:
        raise BundleError(f"{where}: archive member {printable(name)} inflates past {MAX_READ:,} bytes: {FIX}")
    return data


# Tensor operators that read and write tensors only (none touches a file, a socket or a process):
# what our refinement graphs compile to, in TorchScript (``torch.NAME``) and in a torch.export
# program (``torch.ops.aten.NAME.OVERLOAD``), with close relatives so a refactoring need not
# reopen this list. ``aten::save``, ``aten::from_file`` and ``debugprims::load_tensor`` are the
# registered operators that touch files; they and every custom namespace stay out.
TENSOR_OPS = frozenset("""
    abs add addmm alias bmm bucketize cat ceil chunk clamp clamp_max clamp_min clone contiguous cumsum
    detach dim div eq exp expand expand_as expm1 flatten floor full_like gather ge gelu gt index
    index_select le linear log log1p log_sigmoid logical_and logical_not logical_or logsumexp lt matmul
    max maximum mean min minimum mm mul narrow ne neg numel ones_like permute pow reciprocal relu
    reshape round rsqrt select sigmoid sign size slice softplus split sqrt squeeze stack sub sum sym_numel
    sym_size sym_stride t tanh to transpose unsqueeze view where zeros_like
    _assert_scalar _assert_tensor_metadata _to_copy _unsafe_view
""".split())
# bare names TorchScript's printer emits: builtins, type names and the keywords of its statements
# (not import, from, global, lambda, with, try: none is TorchScript, and an import would be a way out)
_SCRIPT_BUILTINS = frozenset({
    "annotate", "bool", "int", "float", "len", "range", "isinstance", "min", "max", "abs", "List", "Optional",
    "Tuple", "Dict", "Tensor", "Module", "str", "Any", "NoneType", "__torch__", "torch",
    "def", "class", "if", "elif", "else", "for", "while", "in", "is", "not", "and", "or", "return", "pass",
    "break", "continue", "assert", "None", "True", "False"})

TORCHSCRIPT_MEMBERS = re.compile(
    r"(?P<root>[A-Za-z0-9_]+)/(?:data\.pkl|constants\.pkl|version|byteorder|\.data/version|\.data/serialization_id"
    r"|data/\d+|constants/\d+|code/__torch__/dwise_predict/(?:\w+/)*\w+\.py(?:\.debug_pkl)?)")


def check_torchscript(data: bytes, where: str) -> None:
    """``refine.pt``: only our exporter's members; its pickles name only :data:`TORCHSCRIPT_GLOBALS`
    (torch's own C++ unpickler refuses other globals too, but a wrong bundle should fail here, named);
    its code calls only :data:`TENSOR_OPS` (:func:`check_script_code`)."""
    archive = _archive(data, where, TORCHSCRIPT_MEMBERS)
    for name in archive.namelist():
        if name.endswith(("pkl", "debug_pkl")):
            check_pickle(_read(archive, name, where), f"{where} ({name})", TORCHSCRIPT_GLOBALS)
        elif name.endswith(".py"):
            check_script_code(_read(archive, name, where), f"{where} ({name})")


def _significant(tokens: list[tokenize.TokenInfo]) -> list[tokenize.TokenInfo]:
    skip = (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
    return [t for t in tokens if t.type not in skip]


def _tokens(text: bytes | str, where: str, what: str) -> list[tokenize.TokenInfo]:
    try:
        source = text.decode() if isinstance(text, bytes) else text
        return _significant(list(tokenize.generate_tokens(io.StringIO(source).readline)))
    except (UnicodeDecodeError, tokenize.TokenError, SyntaxError) as err:
        raise BundleError(f"{where}: its {what} does not parse ({err}): refusing to load it; {FIX}") from None


def check_script_code(code: bytes, where: str) -> None:
    """TorchScript source (Python syntax) that calls nothing but tensor arithmetic.

    Every dotted name starting at ``torch`` must be ``torch.OP`` with OP in :data:`TENSOR_OPS`;
    ``__torch__`` names only our own classes and functions; ``ops`` (custom and ``prim``/``aten``
    operators by namespace) never appears; any other bare name must be bound in the archive's code
    (a parameter, a local, a def) or be one of TorchScript's harmless builtins. A TorchScript program
    cannot import or call Python, so its only ways out are these names.
    """
    tokens = _tokens(code, where, "TorchScript code")
    bound = _bound_names(tokens)
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.NAME or (i and tokens[i - 1].string == "."):
            continue
        chain = _dotted(tokens, i)
        if tok.string == "torch":
            ok = len(chain) == 2 and chain[1] in TENSOR_OPS
        elif tok.string == "__torch__":
            ok = len(chain) >= 3 and chain[1] == "dwise_predict"
        else:
            ok = tok.string in bound or tok.string in _SCRIPT_BUILTINS
        if not ok:
            raise BundleError(f"{where}: TorchScript code refers to {printable('.'.join(chain))}, which our exported "
                              f"graphs never call (only tensor arithmetic): refusing to load it; {FIX}")


def _dotted(tokens: list[tokenize.TokenInfo], i: int) -> list[str]:
    """The dotted name starting at token ``i``: ``torch.ops.aten.save`` -> ["torch", "ops", "aten", "save"]."""
    chain = [tokens[i].string]
    while i + 2 < len(tokens) and tokens[i + 1].string == "." and tokens[i + 2].type == tokenize.NAME:
        chain.append(tokens[i + 2].string)
        i += 2
    return chain


def _bound_names(tokens: list[tokenize.TokenInfo]) -> set[str]:
    """Names the code binds: defs and classes, parameters and annotated fields (``NAME :``),
    keyword arguments and assignment targets (every bare name left of a line's top-level ``=``)."""
    bound: set[str] = set()
    line: list[tokenize.TokenInfo] = []
    for tok in tokens + [tokenize.TokenInfo(tokenize.NEWLINE, "\n", (0, 0), (0, 0), "")]:
        if tok.type != tokenize.NEWLINE:
            line.append(tok)
            continue
        depth = 0
        for j, t in enumerate(line):
            after_dot = j and line[j - 1].string == "."
            if t.type == tokenize.NAME and not after_dot:
                before = line[j - 1].string if j else ""
                after = line[j + 1].string if j + 1 < len(line) else ""
                if before in ("def", "class", "for") or after in (":", "="):
                    bound.add(t.string)
            if t.type == tokenize.OP:
                depth += t.string in ("(", "[", "{")
                depth -= t.string in (")", "]", "}")
            if t.type == tokenize.OP and t.string == "=" and depth == 0:
                bound |= {u.string for k, u in enumerate(line[:j])
                          if u.type == tokenize.NAME and not (k and line[k - 1].string == ".")}
                break
        line = []
    return bound


PROGRAM_MEMBERS = re.compile(
    r"(?P<root>[A-Za-z0-9_]+)/(?:archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/model\.json|data/weights/model_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/model_constants_config\.json|data/constants/tensor_\d+|data/sample_inputs/model\.pt)")
# torch.save's zip format: what torch.export writes as a program's sample inputs
SAVED_TENSOR_MEMBERS = re.compile(
    r"(?P<root>[A-Za-z0-9_]+)/(?:data\.pkl|data/\d+|version|byteorder|\.format_version|\.storage_alignment"
    r"|\.data/version|\.data/serialization_id)")
# a torch.export program's graph nodes: the tensor operators above, shape arithmetic, nothing else
_OPERATOR_TARGET = re.compile(r"torch\.ops\.aten\.(?P<op>\w+)\.\w+|_operator\.(?:getitem|add|sub|mul|floordiv|mod|"
                              r"truediv|neg|eq|ne|lt|le|gt|ge|and_|or_|not_)|torch\.sym_(?:float|int|max|min|not|ite)")
# sympy's srepr of a symbolic size: `Mul(Integer(256), Symbol('s2', positive=True, integer=True))`
_SYMPY_NAMES = frozenset("""
    Symbol Integer Rational Float Mul Add Pow Max Min Mod Abs FloorDiv CeilDiv CleanDiv ModularIndexing
    PythonMod IntTrueDiv FloatTrueDiv TruncToInt CeilToInt FloorToInt Eq Ne Lt Le Gt Ge And Or Not
    True False oo positive negative nonnegative integer real finite
""".split())
# a guard, compiled by torch as Python: `L['budget'].size()[0] == L['prompt_tokens'].size()[0]`
_GUARD_NAMES = frozenset({"L", "size", "stride", "storage_offset", "and", "or", "not"})
_GUARD_OPS = frozenset({"[", "]", "(", ")", ".", "==", "!=", "<=", ">=", "<", ">", "+", "-", "*", "//", "%"})
_EXPR_OPS = frozenset({"(", ")", ",", "=", "+", "-", "*", "/", "**"})


def check_program(data: bytes, where: str) -> None:
    """``refine.pt2``: a torch.export archive that ``torch.export.load`` may open without running
    anything of the archive's.

    torch.export.load unpickles weights and constants marked ``use_pickle`` (``weights_only=False``),
    torchbind and opaque constants, and sample inputs (falling back to ``weights_only=False``);
    evaluates every symbolic size with ``sympy.sympify``; compiles the program's guards as Python;
    and resolves each node's target by name under ``torch``. So: only our exporter's members; no
    pickled weight or constant, no object constant; sample inputs whose pickle names only tensor
    globals; node targets in :data:`TENSOR_OPS`; size expressions and guards in the grammar our
    exports use.
    """
    archive = _archive(data, where, PROGRAM_MEMBERS)
    names = archive.namelist()
    root = names[0].split("/", 1)[0] if names else ""
    for config, prefix in (("data/weights/model_weights_config.json", "weight_"),
                           ("data/constants/model_constants_config.json", "tensor_")):
        member = f"{root}/{config}"
        if member not in names:
            raise BundleError(f"{where} lacks {config}: it is not a torch.export program of ours; {FIX}")
        payloads = loads_json(_read(archive, member, where), BundleError, f"{where} ({config})", FIX)
        entries = payloads.get("config") if isinstance(payloads, dict) else None
        if not isinstance(entries, dict):
            raise BundleError(f"{where} ({config}) has no 'config' object: {FIX}")
        for fqn, payload in entries.items():
            if not isinstance(payload, dict) or payload.get("use_pickle") is not False:
                raise BundleError(f"{where}: {printable(fqn)} is stored as a pickle (use_pickle in {config}), and "
                                  f"unpickling can run code; dwise-predict never writes one: refusing to load it; {FIX}")
            path = payload.get("path_name")
            if not (isinstance(path, str) and re.fullmatch(rf"{prefix}\d+", path)
                    and f"{root}/{config.rsplit('/', 1)[0]}/{path}" in names):
                raise BundleError(f"{where}: {printable(fqn)} points at {printable(path)}, not a tensor file of the "
                                  f"archive (torch.export loads objects from such names): refusing to load it; {FIX}")
    sample = f"{root}/data/sample_inputs/model.pt"
    if sample in names:
        inputs = _archive(_read(archive, sample, where), f"{where} (sample inputs)", SAVED_TENSOR_MEMBERS)
        for name in inputs.namelist():
            if name.endswith(".pkl"):
                check_pickle(_read(inputs, name, where), f"{where} (sample inputs)", TENSOR_GLOBALS)
    model = f"{root}/models/model.json"
    if model not in names:
        raise BundleError(f"{where} lacks models/model.json: it is not a torch.export program; {FIX}")
    _check_program_json(loads_json(_read(archive, model, where), BundleError, f"{where} (model.json)", FIX,
                                   max_bytes=MAX_READ), where)


def _check_program_json(value, where: str, key: str = "") -> None:
    """Walk a serialised program: every field torch would evaluate holds what our exports write."""
    if isinstance(value, dict):
        if key == "range_constraints":
            for symbol in value:
                if not re.fullmatch(r"[a-z]+\d*", symbol):
                    raise BundleError(f"{where}: range constraint {printable(symbol)} is not a symbol name: {FIX}")
        for k, v in value.items():
            _check_program_json(v, where, k)
    elif isinstance(value, list):
        for v in value:
            _check_program_json(v, where, key)
    elif isinstance(value, str):
        if key in ("target", "as_operator"):
            match = _OPERATOR_TARGET.fullmatch(value)
            if match is None or (match.group("op") is not None and match.group("op") not in TENSOR_OPS):
                raise BundleError(f"{where}: a graph node calls {printable(value)}, which our exported graphs never "
                                  f"call (only tensor arithmetic): refusing to load it; {FIX}")
        elif key == "expr_str":
            _check_grammar(value, where, "symbolic size", _SYMPY_NAMES, _EXPR_OPS, r"'[a-z]+\d*'")
        elif key == "guards_code":
            _check_grammar(value, where, "guard", _GUARD_NAMES, _GUARD_OPS, r"'[A-Za-z_]\w*'")
        elif key in ("in_spec", "out_spec"):
            _check_treespec(value, where)


# pytree node types a program's input and output specs may name: torch.export.load resolves a
# defaultdict's factory and an enum in a spec's context by importing the module they name
_TREESPEC_TYPES = (None, "builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict")


def _check_treespec(text: str, where: str) -> None:
    """A serialised pytree spec (``[protocol, node]``) of tuples, lists and dicts whose contexts are
    null or lists of keys: nothing in it names a module or a class."""
    spec = loads_json(text, BundleError, f"{where} (a pytree spec)", FIX)
    nodes = [spec[1]] if isinstance(spec, list) and len(spec) == 2 else [None]
    while nodes:
        node = nodes.pop()
        if not isinstance(node, dict) or node.get("type") not in _TREESPEC_TYPES:
            kind = node.get("type") if isinstance(node, dict) else node
            raise BundleError(f"{where}: a pytree spec holds the node {printable(kind)}, which our exports never "
                              f"write (torch would import what it names): refusing to load it; {FIX}")
        context = node.get("context")
        keys = loads_json(context, BundleError, f"{where} (a pytree context)", FIX) if isinstance(context, str) else context
        if keys is not None and not (isinstance(keys, list) and all(isinstance(k, (str, int)) for k in keys)):
            raise BundleError(f"{where}: a pytree spec's context is {printable(context, 60)}, not a list of keys "
                              f"(torch would import what it names): refusing to load it; {FIX}")
        children = node.get("children_spec") or []
        nodes.extend(children if isinstance(children, list) else [None])


def _check_grammar(text: str, where: str, what: str, names: frozenset, ops: frozenset, string: str,
                   symbols: str = r"[a-z]+\d+") -> None:
    """``text`` is made of ``names``, symbol names (``s0``), ``ops``, numbers and string literals
    fullmatching ``string`` only: nothing evaluated from it can reach an attribute, a builtin or an
    import."""
    for tok in _tokens(text, where, what):
        ok = (tok.type in (tokenize.NUMBER, tokenize.NEWLINE, tokenize.ENDMARKER)
              or (tok.type == tokenize.NAME and (tok.string in names or re.fullmatch(symbols, tok.string)))
              or (tok.type == tokenize.OP and tok.string in ops)
              or (tok.type == tokenize.STRING and re.fullmatch(string, tok.string)))
        if not ok:
            raise BundleError(f"{where}: a {what} holds {printable(tok.string)} ({printable(text, 60)}), which torch "
                              f"would evaluate as code and our exports never write: refusing to load it; {FIX}")


# --- ONNX -----------------------------------------------------------------------------------------

def check_onnx(data: bytes, where: str, inputs: dict[str, list], outputs: dict[str, list],
               bounds: tuple[frozenset, int, int]) -> None:
    """An ONNX graph whose every tensor is inside the file (external data names a path onnxruntime
    would open, relative to the model's directory or not), whose inputs and outputs are ``inputs``
    / ``outputs`` (name -> dims, ``None`` for the batch axis (any)), and whose every run is bounded:
    ``bounds`` are the operators, constant numbers and numbers per request it may use
    (:func:`~dwise_predict.bundles.graph_bounds.check_graph_bounds`).

    The protobuf is parsed by ``onnx`` (data, never executed); callers then give onnxruntime the
    same bytes, so no path in the graph resolves against the bundle's directory.
    """
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as err:
        raise BundleError(f"{where} is not a readable ONNX graph ({str(err).splitlines()[0] if str(err) else err!r}): "
                          f"{FIX}") from None
    for tensor in _onnx_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.external_data):
            location = next((e.value for e in tensor.external_data if e.key == "location"), "?")
            raise BundleError(f"{where}: tensor {printable(tensor.name)} is stored outside the file (external data at "
                              f"{printable(location)}), which our exports never do: refusing to load it; {FIX}")
    initializers = {t.name for t in model.graph.initializer}
    _check_signature(where, "input", [v for v in model.graph.input if v.name not in initializers], inputs)
    _check_signature(where, "output", list(model.graph.output), outputs)
    check_graph_bounds(model, where, *bounds)


def _onnx_tensors(model):
    """Every TensorProto of a model: initializers, sparse ones, node attributes, in subgraphs and functions."""
    def graph_tensors(graph):
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        for node in graph.node:
            yield from node_tensors(node)

    def node_tensors(node):
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("sparse_tensor"):
                yield attribute.sparse_tensor.values
                yield attribute.sparse_tensor.indices
            for sparse in attribute.sparse_tensors:
                yield sparse.values
                yield sparse.indices
            if attribute.HasField("g"):
                yield from graph_tensors(attribute.g)
            for graph in attribute.graphs:
                yield from graph_tensors(graph)

    yield from graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from node_tensors(node)


def _check_signature(where: str, kind: str, values, expected: dict[str, list]) -> None:
    got = {}
    for value in values:
        dims = value.type.tensor_type.shape.dim
        got[value.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    if sorted(got) != sorted(expected):
        raise BundleError(f"{where} has {kind}s {', '.join(map(printable, sorted(got)))}, not "
                          f"{', '.join(sorted(expected))}: it is not this bundle's graph; {FIX}")
    for name, dims in expected.items():
        have = got[name]
        if len(have) != len(dims) or any(d is not None and h != d for h, d in zip(have, dims)):
            shown = ["B" if d is None else d for d in have]
            raise BundleError(f"{where}: {kind} '{name}' has shape {shown}, but bundle.json declares "
                              f"{['B' if d is None else d for d in dims]}: the graph is not this bundle's; {FIX}")


# --- safetensors, calibration ------------------------------------------------------------------------

def safetensors_header(data: bytes, where: str) -> dict[str, tuple[str, list[int]]]:
    """A safetensors file's tensors, name -> (dtype, shape), from its JSON header (the format:
    8-byte little-endian header length, header, data), every tensor's bytes inside the file."""
    if len(data) < 8:
        raise BundleError(f"{where} is not a safetensors file (too short): {FIX}")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(len(data) - 8, 100 << 20):
        raise BundleError(f"{where} is not a safetensors file (its header claims {size:,} bytes): {FIX}")
    header = loads_json(data[8:8 + size], BundleError, f"{where} (header)", FIX)
    if not isinstance(header, dict):
        raise BundleError(f"{where}: its safetensors header is not an object: {FIX}")
    tensors, room = {}, len(data) - 8 - size
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(entry.get("dtype"), str) and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape) and isinstance(offsets, list) and len(offsets) == 2
                and all(type(o) is int for o in offsets) and 0 <= offsets[0] <= offsets[1] <= room):
            raise BundleError(f"{where}: tensor {printable(name)} has a malformed safetensors entry: {FIX}")
        item = SAFETENSORS_ITEM_BYTES.get(entry["dtype"])
        numbers = math.prod(shape)
        if item is None or offsets[1] - offsets[0] != numbers * item:
            raise BundleError(f"{where}: tensor {printable(name)} is {printable(entry['dtype'])} {shape[:8]} "
                              f"({numbers:,} numbers) but its data_offsets span {offsets[1] - offsets[0]:,} bytes: "
                              f"{FIX}")
        tensors[name] = (entry["dtype"], shape)
    return tensors


def _check_tensors(where: str, tensors: dict, expected: dict[str, list[int]], optional: tuple[str, ...] = ()) -> None:
    for name, shape in expected.items():
        if name not in tensors:
            if name in optional:
                continue
            raise BundleError(f"{where} lacks the tensor '{name}': {FIX}")
        dtype, have = tensors[name]
        if dtype != "F32" or have != shape:
            raise BundleError(f"{where}: tensor '{name}' is {dtype} {have}, but bundle.json declares F32 {shape}: "
                              f"the file is not this bundle's; {FIX}")


def check_refine_weights(data: bytes, where: str, spec: dict) -> None:
    """``refine.safetensors``: float32 tensors whose input width is ``in_features`` (2H + 2 + signals)."""
    tensors = safetensors_header(data, where)
    width = spec["in_features"]
    _check_tensors(where, tensors, {"input_mean": [width], "input_std": [width]})
    for name, (dtype, shape) in tensors.items():
        if name.endswith("fc1.weight") and (len(shape) != 2 or shape[1] != width):
            raise BundleError(f"{where}: tensor '{name}' is {shape}, but bundle.json declares {width} input columns "
                              f"(hidden size {spec['hidden_size']}): the file is not this bundle's; {FIX}")


def check_probes(data: bytes, where: str, hidden: int) -> None:
    """``probes.safetensors``: N float32 rows of every refinement input at this hidden size, their
    eager outputs, and admission features (3 columns) with LightGBM's outputs."""
    tensors = safetensors_header(data, where)
    rows = tensors.get("refine.first_round", ("", [0]))[1][0]
    if not 1 <= rows <= MAX_PROBES:
        raise BundleError(f"{where} holds {rows:,} probe rows, not 1 to {MAX_PROBES:,}: {FIX}")
    expected = {"refine.first_round": [rows, hidden], "refine.prompt_last": [rows, hidden],
                "refine.prompt_tokens": [rows], "refine.budget": [rows], "refine.early_signals": [rows, SIGNAL_COUNT],
                "refine.remaining_rounds": [rows], "refine.raw_estimate": [rows],
                "admission.features": [rows, 3], "admission.total_rounds": [rows]}
    _check_tensors(where, tensors, expected, optional=("refine.raw_estimate",))  # older bundles lack it


def read_calibration(data: bytes, where: str) -> dict:
    """``calibration.json``: isotonic knots ``x`` and ``y``, equally many finite numbers, each non-decreasing."""
    calibration = loads_json(data, BundleError, where, FIX)
    knots = [calibration.get(k) if isinstance(calibration, dict) else None for k in ("x", "y")]
    if not all(isinstance(k, list) and 1 <= len(k) <= MAX_KNOTS for k in knots) or len(knots[0]) != len(knots[1]):
        raise BundleError(f"{where} must hold lists 'x' and 'y' of equally many knots (1 to {MAX_KNOTS:,}): {FIX}")
    for axis, values in zip("xy", knots):
        if not all(type(v) in (int, float) and math.isfinite(v) for v in values):
            raise BundleError(f"{where}: '{axis}' holds a knot that is not a finite number: {FIX}")
        if any(b < a for a, b in zip(values, values[1:])):
            raise BundleError(f"{where}: '{axis}' decreases somewhere, so the map is not isotonic: {FIX}")
    return calibration


# --- the bundle ----------------------------------------------------------------------------------

def check_layout(bundle: str | Path, manifest: BundleManifest) -> None:
    """What a bundle directory holds and what its manifest lists, before any byte of a file is read.

    Refused: a symbolic link (it can point anywhere: reading it would read outside the bundle), a
    directory, device or pipe (a FIFO blocks a reader, a device never ends), a name that is not one
    of :data:`BUNDLE_ARTIFACTS` in the directory (a planted ``.pkl``, ``.joblib`` or ``.npy`` is
    never read), a required artifact missing from ``files``, ``probes`` naming another file, and an
    ``int8`` record that contradicts the files. (The names, hashes and declared sizes in ``files``
    and ``inputs.refine`` were checked when the manifest was read: :meth:`BundleManifest.from_dict`.)
    """
    bundle = Path(bundle)
    where = f"{bundle}/{BUNDLE_FILE}"
    files = manifest.files
    unknown = []
    for entry in sorted(os.scandir(bundle), key=lambda e: e.name):
        path = bundle / entry.name
        mode = entry.stat(follow_symlinks=False).st_mode
        if stat.S_ISLNK(mode):
            raise BundleError(f"{path} is a symbolic link (to {printable(os.readlink(path))}): a bundle holds only "
                              f"regular files, and a link can point outside it; refusing to read the bundle; {FIX}")
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a device, pipe or socket"
            raise BundleError(f"{path} is {kind}: a bundle holds only regular files; refusing to read the bundle; {FIX}")
        if entry.name != BUNDLE_FILE and entry.name not in BUNDLE_ARTIFACTS:
            unknown.append(printable(entry.name, quoted=False))
    if unknown:
        raise BundleError(f"{bundle} holds files that its {BUNDLE_FILE} does not list ({', '.join(unknown)}): a "
                          "bundle holds only the files dwise-predict exports, and these were added after export; "
                          "refusing to read the bundle; re-export or re-pull it")
    missing = [name for name in REQUIRED_ARTIFACTS if name not in files]
    if missing:
        raise BundleError(f"{where} lists no {', '.join(missing)}: the bundle is incomplete; {FIX}")
    if manifest.probes != PROBES_FILE:
        raise BundleError(f"{where}: 'probes' is {printable(manifest.probes)}, not '{PROBES_FILE}': {FIX}")
    artifacts = manifest.artifacts
    if not isinstance(artifacts, dict) or sorted(artifacts) != sorted(files):
        raise BundleError(f"{where}: 'artifacts' must describe exactly the files listed in 'files': {FIX}")
    kept = manifest.int8.get("kept")
    if kept is not ("refine.int8.onnx" in files):
        raise BundleError(f"{where}: int8.kept is {printable(kept)}, but refine.int8.onnx is "
                          f"{'' if 'refine.int8.onnx' in files else 'not '}listed: {FIX}")


def screen_bytes(name: str, data: bytes, where: str, manifest: BundleManifest):
    """Check one artifact's bytes against what it may hold (the module docstring); return what a
    loader needs from it: the parsed calibration for ``calibration.json``, else None."""
    spec, hidden = manifest.refine, manifest.hidden_size
    refine_io = ({**{state: [None, hidden] for state in HIDDEN_STATES}, "prompt_tokens": [None], "budget": [None],
                  "early_signals": [None, SIGNAL_COUNT]}, {"remaining_rounds": [None]})
    files = manifest.files
    if name in ("refine.onnx", "refine.int8.onnx"):
        # the graph holds the weights of refine.safetensors (float32) and the calibration knots
        # (twice over: an exporter that kept a transposed copy of a weight would still pass)
        numbers = files["refine.safetensors"]["bytes"] // 2 + files["calibration.json"]["bytes"] // 2 + SLACK
        check_onnx(data, where, *refine_io, (REFINE_OPS, numbers, row_budget(spec)))
    elif name == "admission.onnx":
        # the trees' node lists, each number of which admission.txt writes in a few characters
        numbers = files["admission.txt"]["bytes"] + SLACK
        check_onnx(data, where, {"features": [None, 3]}, {"total_rounds": [None]},
                   (ADMISSION_OPS, numbers, ADMISSION_ROW_NUMBERS))
    elif name == "refine.safetensors":
        check_refine_weights(data, where, spec)
    elif name == PROBES_FILE:
        check_probes(data, where, hidden)
    elif name == "calibration.json":
        return read_calibration(data, where)
    elif name == "refine.pt":
        check_torchscript(data, where)
    elif name == "refine.pt2":
        check_program(data, where)
    elif name == "admission.txt":
        from dwise_predict.admission.model_text import check_model_text

        check_model_text(data, where, BundleError)
    return None


def read_checked(bundle: str | Path, manifest: BundleManifest, name: str) -> bytes:
    """The bytes of artifact ``name``, once its size and sha256 match the manifest and its content
    passes :func:`screen_bytes`: what a loader deserialises (never the path, which could change)."""
    path = Path(bundle) / name
    entry = manifest.files.get(name)
    if entry is None or name not in BUNDLE_ARTIFACTS:
        raise BundleError(f"{Path(bundle) / BUNDLE_FILE} lists no '{name}': the bundle is incomplete; {FIX}")
    if path.is_symlink() or not path.is_file():
        raise BundleError(f"{path} is missing or not a regular file: {FIX}")
    if name in TEXT_ARTIFACTS and entry["bytes"] > MAX_READ:  # refused before it is read into memory
        raise BundleError(f"{path} holds {entry['bytes']:,} bytes, more than the {MAX_READ:,} such a file may: {FIX}")
    if path.stat().st_size != entry["bytes"]:
        raise BundleError(f"{path} does not match its sha256 in {BUNDLE_FILE}: the file was modified or corrupted")
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise BundleError(f"{path} does not match its sha256 in {BUNDLE_FILE}: the file was modified or corrupted")
    screen_bytes(name, data, str(path), manifest)
    return data


def open_bundle(bundle: str | Path) -> BundleManifest:
    """The sealed manifest of a bundle about to be loaded, its layout checked (:func:`check_layout`)
    and every listed file's size and sha256 matched. Load each file through :func:`read_checked`."""
    manifest = read_bundle_manifest(bundle)
    check_layout(bundle, manifest)
    check_files(bundle, manifest)
    return manifest


def screen_bundle(bundle: str | Path, manifest: BundleManifest) -> None:
    """Screen the content of every listed file (:func:`screen_bytes`); the model card, which no
    reader parses, only by its hash (:func:`open_bundle`)."""
    for name in sorted(manifest.files):
        if name != "README.md":
            read_checked(bundle, manifest, name)
