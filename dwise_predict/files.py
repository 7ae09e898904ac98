"""Files and directories written atomically, file hashes, and the one lock scheme.

- :func:`atomic_write` (+ ``_bytes``, ``_text``, :func:`write_json`, :func:`write_csv`): temp file beside the target +
  rename, so a reader, or a rerun after an interrupt, sees the old file or the new one, never half.
- :func:`atomic_dir`: the same for a whole directory (a run, a bundle, a pulled bundle, a model).
- :func:`claim_output`: what every command that writes a directory does first: refuse an ``--out``
  that is, contains or lies inside one of its inputs, or that holds something not recognisably
  ours, then hold the output's lock (:func:`hold_output_lock`, also for a single output file).
- :class:`FileLock`: ``fcntl.flock`` on a lock file, so the OS releases it when its holder dies;
  a crashed writer never leaves a lock behind that a user has to delete by hand. This is the one
  lock scheme: a directory written whole is locked by ``.NAME.lock`` beside it, removed on release
  (:func:`output_lock`), a directory written in place (a trace store, a zoo) by a ``.lock`` inside.
- :func:`write_errors`: a full or read-only disk as one line.
- :func:`loads_json` / :func:`read_json` / :func:`read_json_object`: the one reader of JSON from outside
  this process (a manifest, a run's files, a config, a profile, a bundle, a zoo index), strict and
  with size and depth limits, so damaged or hostile JSON is one typed error, never a
  ``RecursionError`` or a memory blow-up.
- :func:`output_path`: an ``--out`` that is a symbolic link names the directory it points to.
- :func:`sha256_file`.

Temporary files and directories are named ``.NAME.tmp-PID``; those of processes that no longer run
are removed by the next write of the same target, and an overwrite interrupted between its two
renames is put back (:func:`sweep_stale`).

Standard library only, so the serving side may import it.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import glob
import hashlib
import io
import json
import os
import re
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from dwise_predict.errors import InputError, LockHeldError, StoreError
from dwise_predict.text import csv_cell

TMP_MARK = ".tmp-"
# what a failed write means to a user, by errno
WRITE_FAILURES = {
    errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk is full", errno.EFBIG: "the disk is full",
    errno.EACCES: "it is not writable", errno.EPERM: "it is not writable", errno.EROFS: "it is not writable",
}
# JSON we are handed: nothing we write comes near these (a manifest or config is a few KiB and a
# handful of levels deep; the largest report, evaluation.json, a few MiB), so more is damage or an
# attack. Refused before parsing, so that it cannot exhaust memory, or the stack (Python's json
# recurses per level: a file of 100,000 '[' raises RecursionError).
JSON_MAX_BYTES = 64 << 20
JSON_MAX_DEPTH = 64
# a string, or an unterminated one to the end: matched once each, so the scan stays linear (a closing
# quote required, '"' + '\\"' * n was tried from every quote to the end: quadratic, hours at 64 MB);
# runs of plain characters are taken whole (one alternation per character took 4 s for a 15 MiB field)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")


@contextmanager
def write_errors(out: str | os.PathLike, fix: str, every: bool = False) -> Iterator[None]:
    """Turn an ``OSError`` while writing ``out`` into one :class:`StoreError` line ending in ``fix``.

    every : any ``OSError`` (the block only writes); otherwise only a full disk and a read-only or
        forbidden target, so that a missing input still reports itself.
    """
    try:
        yield
    except OSError as exc:
        what = WRITE_FAILURES.get(exc.errno)
        if what is None and exc.errno in (errno.ENOTDIR, errno.EEXIST):
            what = "a file is in the way of the directory"
        if what is None and not every:
            raise
        what = what or exc.strerror or str(exc)
        raise StoreError(f"cannot write to {out} ({what}: {exc.filename or out}): {fix}") from None


def atomic_write(target: str | os.PathLike, write: Callable[[Path], None], durable: bool = False) -> Path:
    """Call ``write(tmp)`` on a temp path beside ``target``, then rename it over ``target``.

    durable : also fsync the file and its directory, so the rename survives a power loss (the
        collection store commits shards this way; reports and models don't need to).
    """
    target = output_path(target)
    sweep_stale(target)
    tmp = _tmp_path(target)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # whatever wrote it (safetensors, mkstemp), what we publish is meant to be read
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, target)
        if durable:
            dir_fd = os.open(target.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def atomic_write_bytes(target: str | os.PathLike, data: bytes, durable: bool = False) -> Path:
    return atomic_write(target, lambda tmp: tmp.write_bytes(data), durable)


def atomic_write_text(target: str | os.PathLike, text: str) -> Path:
    return atomic_write(target, lambda tmp: tmp.write_text(text))


def _json_default(value):
    if hasattr(value, "tolist"):  # numpy scalars and arrays, without importing numpy
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def write_json(target: str | os.PathLike, value) -> Path:
    """``value`` as indented JSON (numpy scalars and arrays as plain numbers; NaN refused)."""
    text = json.dumps(value, indent=2, default=_json_default, allow_nan=False) + "\n"
    return atomic_write_text(target, text)


def loads_json(data: bytes | str, error: type[Exception], name: str, fix: str = "",
               max_bytes: int | None = JSON_MAX_BYTES, max_depth: int = JSON_MAX_DEPTH, allow_nan: bool = False) -> Any:
    """The value of the JSON ``data``, read strictly and bounded; ``error`` (a typed error class) when
    ``data`` is larger than ``max_bytes`` (None: no limit, for a user's data set), nests deeper than
    ``max_depth``, is not UTF-8 or not JSON, or holds NaN or Infinity (not JSON; ``allow_nan`` reads
    them, for the few files of ours written with them, e.g. a diverged loss). A number of more than
    4,300 digits is refused too (Python's limit on int parsing raises ValueError, not a decoding
    error). ``name`` is how the message calls the data, ``fix`` what it adds after a colon (what the
    user can do)."""
    suffix = f": {fix}" if fix else ""
    if max_bytes is not None and len(data) > max_bytes:
        raise error(_too_large(name, len(data), max_bytes, suffix))
    try:
        text = data.decode() if isinstance(data, bytes) else data
    except UnicodeDecodeError as err:
        raise error(f"{name} is not UTF-8 text ({err.reason} at byte {err.start}){suffix}") from None
    # counted before parsing, so a deep value is never built (nor the stack exhausted)
    too_deep = f"{name} nests arrays or objects more than {max_depth} deep, which no JSON we write does{suffix}"
    if _json_depth(text, max_depth) > max_depth:
        raise error(too_deep)

    def refuse_constant(constant: str):
        raise ValueError(f"{constant} is not a JSON number")

    try:
        return json.loads(text, parse_constant=None if allow_nan else refuse_constant)
    except ValueError as err:  # JSONDecodeError, NaN/Infinity, an int of too many digits
        raise error(f"{name} is not valid JSON ({str(err).splitlines()[0]}){suffix}") from None
    except RecursionError:  # brackets the count above missed in text that is not JSON anyway
        raise error(too_deep) from None


def _too_large(name: str, size: int, max_bytes: int, suffix: str) -> str:
    return f"{name} holds {size:,} bytes of JSON, more than the {max_bytes:,} this reads{suffix}"


def _json_depth(text: str, limit: int) -> int:
    """How deeply ``text``'s arrays and objects nest (brackets inside strings do not count), counted
    up to just past ``limit``."""
    depth = deepest = 0
    for bracket in _NOT_A_BRACKET.sub("", _JSON_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > limit:
                break
    return deepest


def read_json(path: str | os.PathLike, error: type[Exception], name: str | None = None, fix: str = "",
              max_bytes: int | None = JSON_MAX_BYTES, allow_nan: bool = False) -> Any:
    """The JSON value in the file ``path`` (see :func:`loads_json`); its size is checked before it is
    read. An ``OSError`` (a missing file) is left to the caller."""
    name = name or str(path)
    if max_bytes is not None and (size := os.stat(path).st_size) > max_bytes:
        raise error(_too_large(name, size, max_bytes, f": {fix}" if fix else ""))
    return loads_json(Path(path).read_bytes(), error, name, fix, max_bytes, allow_nan=allow_nan)


def read_json_object(path: str | os.PathLike, error: type[Exception], name: str | None = None,
                     fix: str = "", max_bytes: int | None = JSON_MAX_BYTES, allow_nan: bool = False) -> dict:
    """The JSON object in ``path``; ``error`` (a typed error class) when the file is not valid JSON,
    too large or too deep (:func:`read_json`), or holds something else. ``name`` is how the message
    calls the file (default: its path), ``fix`` what it adds after a colon (what the user can do)."""
    name = name or str(path)
    value = read_json(path, error, name, fix, max_bytes, allow_nan)
    if not isinstance(value, dict):
        raise error(f"{name} does not hold a JSON object" + (f": {fix}" if fix else ""))
    return value


def write_csv(target: str | os.PathLike, rows: list[dict]) -> Path:
    """``rows`` as CSV with a header (the union of their keys, in first-seen order); a text cell that
    a spreadsheet would run as a formula (a category ``=1+1``) is neutralised (:func:`~dwise_predict.text.csv_cell`)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
    writer.writeheader()
    writer.writerows({k: csv_cell(v) for k, v in row.items()} for row in rows)
    return atomic_write_text(target, buffer.getvalue())


@contextmanager
def atomic_dir(out: str | os.PathLike, merge: bool = False) -> Iterator[Path]:
    """Yield a fresh hidden directory beside ``out`` to fill; on success move it to ``out``.

    An interrupted or failed block leaves no directory that looks complete (the temporary one is
    removed, and leftovers of dead processes are removed on the next call). An existing ``out`` is
    replaced only once the new one is complete, and put back if the final rename fails; an ``out``
    that is a symbolic link is the directory it points to (:func:`output_path`). With
    ``merge`` the finished files are moved into ``out`` one by one instead (each rename atomic),
    keeping what else ``out`` holds (a model directory next to its training checkpoint).

    Raises
    ------
    StoreError
        The directory beside ``out`` cannot be written, or the disk fills or turns read-only while
        the block writes (:func:`write_errors`).
    """
    out = output_path(out)
    tmp = _fresh_tmp_dir(out)
    try:
        with write_errors(out, "nothing was replaced; free space or fix permissions and rerun the same command"):
            yield tmp
            for path in tmp.iterdir():
                path.chmod(0o755 if path.is_dir() else 0o644)  # temporary files are private; what we publish is meant to be read
            if merge:
                out.mkdir(exist_ok=True)
                for path in sorted(tmp.iterdir()):
                    os.replace(path, out / path.name)
            else:
                _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an old ``out`` is removed only after the rename."""
    if not out.exists():
        os.replace(tmp, out)
        return
    old = tmp.with_name(tmp.name + "-old")
    os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _tmp_path(target: Path) -> Path:
    return target.with_name(f".{_derived_stem(target.name)}{TMP_MARK}{os.getpid()}")


# what our names add to a target's: "." + TMP_MARK + a pid (Linux's pid_max, 4194304, has 7 digits) +
# "-old"; the lock's "." + ".lock" is shorter
_DERIVED_ROOM = 1 + len(TMP_MARK) + 7 + len("-old")
NAME_MAX = 255  # bytes in one file name: Linux's file systems, macOS's APFS


def _derived_stem(name: str) -> str:
    """``name`` as the stem of its temporary and lock files: itself, or where those would pass
    :data:`NAME_MAX` (a legal 250-byte `out`), its head and a hash of the whole, so they still fit."""
    if len(os.fsencode(name)) + _DERIVED_ROOM <= NAME_MAX:
        return name
    digest = hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
    head = os.fsencode(name)[: NAME_MAX - _DERIVED_ROOM - len(digest) - 1].decode("utf-8", "ignore")
    return f"{head}~{digest}"


def sweep_stale(target: str | os.PathLike) -> None:
    """Remove the temporary files and directories of ``target`` left by processes that no longer run.

    An overwrite killed between its two renames (old ``target`` moved aside, new one not yet in
    place) left the old directory as ``.NAME.tmp-PID-old``: it is renamed back to ``target``, so a
    rerun starts from the state before the interrupted command.
    """
    target = Path(target)
    if not target.parent.is_dir():
        return
    for stale in sorted(target.parent.glob(f".{glob.escape(_derived_stem(target.name))}{TMP_MARK}*")):
        pid = stale.name.removesuffix("-old").rsplit("-", 1)[-1]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        if stale.name.endswith("-old") and stale.is_dir() and not os.path.lexists(target):
            os.replace(stale, target)
        elif stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _fresh_tmp_dir(out: Path) -> Path:
    """A new hidden directory next to ``out``; removes leftovers of processes that no longer run."""
    out.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale(out)
    tmp = _tmp_path(out)
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
    except OSError as err:
        raise StoreError(f"cannot write next to {out}: {err.strerror}") from None
    return tmp


def refuse_aliasing(out: str | os.PathLike, inputs: Iterable[tuple[str, str | os.PathLike | None]],
                    param: str = "out") -> None:
    """Raise :class:`InputError` when ``out`` is, contains or lies inside one of ``inputs``.

    ``inputs`` pairs how the message names an input (``"TRACES"``, ``"`run`"``) with its path (None:
    not given); ``param`` is the parameter that names ``out``. Paths are compared after resolving links,
    so ``d/..`` and a symlink alias too.
    """
    target = Path(out).resolve()
    for label, path in inputs:
        if path is None:
            continue
        source = Path(path).resolve()
        if target == source:
            relation = "is"
        elif target in source.parents:
            relation = "contains"
        elif source in target.parents:
            relation = "lies inside"
        else:
            continue
        raise InputError(f"`{param}` {out} {relation} the input {label} {path}: a command never writes over its "
                         f"inputs; choose a `{param}` outside them")


def output_lock(out: str | os.PathLike) -> FileLock:
    """The lock of a directory that is written whole: ``.NAME.lock`` beside it (it survives the swap;
    removed on release)."""
    out = Path(out)
    return FileLock(out.parent / f".{_derived_stem(out.name)}.lock", lambda holder: (
        f"{out} is being written by another dwise-predict process (pid {holder}): wait for it to finish, "
        "or choose another `out`"), transient=True)


@contextmanager
def claim_output(out: str | os.PathLike, inputs: Iterable[tuple[str, str | os.PathLike | None]], what: str, marker: str,
                 replace: bool = False, param: str | None = None, contents: Iterable[str] | None = None) -> Iterator[Path]:
    """Check ``out`` may be written and hold its lock (:func:`output_lock`) for the block.

    Refused: an ``out`` that aliases an input (:func:`refuse_aliasing`), a file, a dangling link,
    and a non-empty directory unless ``replace`` and it is recognisably ``what`` (it holds
    ``marker``): a trace dataset or a foreign folder is never replaced. ``contents``: glob patterns
    of every name ``what`` holds; given, a directory holding anything else is refused too, marker or
    not (a command that adds its files beside earlier ones, like ``simulate``, must not write into a
    folder of the user's that happens to hold one of its files). ``param`` names the parameter
    that sets ``replace`` (None: the command always replaces its own kind of output); ``what`` is
    how messages call that kind (``"a run directory"``). An ``out`` that is a symbolic link stands
    for the directory it points to (:func:`output_path`); the block gets that directory. An
    overwrite interrupted by a crash is restored first (:func:`sweep_stale`).
    """
    out = Path(out)
    if os.path.islink(out) and not out.exists():
        raise InputError(f"`out` {out} is a link to {os.readlink(out)}, which does not exist: remove the link "
                         "or choose another `out`")
    refuse_aliasing(out, inputs)
    if out.exists() and not out.is_dir():
        raise InputError(f"`out` {out} is a file: give a directory")
    named, out = out, output_path(out)
    with hold_output_lock(out):
        sweep_stale(out)
        if out.is_dir():
            _sweep_inside(out)
        if out.is_dir() and any(out.iterdir()):
            if not (out / marker).is_file():
                raise StoreError(f"{named} holds files but is not {what} (no {marker}): it is never replaced; "
                                 "choose a new or empty `out`")
            foreign = [] if contents is None else _foreign_entries(out, tuple(contents))
            if foreign:
                shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
                raise StoreError(f"{named} holds {shown}, which {what} never holds: a folder with files of yours is "
                                 "never replaced or written into; move them out or choose a new or empty `out`")
            if not replace:
                raise StoreError(f"{named} already exists: choose another `out`"
                                 + (f" or pass `{param}` to replace it" if param else ""))
        yield out


def _sweep_inside(out: Path) -> None:
    """The temporary files that dead processes left inside ``out`` (a command writing its files into
    ``out`` one by one, killed mid-write), swept as those beside it are: left there, they made the
    rerun take its own output for a folder of someone else's."""
    for entry in list(out.iterdir()):
        if entry.name.startswith(".") and TMP_MARK in entry.name:
            sweep_stale(out / entry.name[1:].split(TMP_MARK)[0])


def _foreign_entries(out: Path, contents: tuple[str, ...]) -> list[str]:
    """The names in ``out`` that match none of the patterns ``contents`` (our temporary files aside)."""
    return sorted(p.name for p in out.iterdir()
                  if TMP_MARK not in p.name and not any(fnmatch(p.name, pattern) for pattern in contents))


def output_path(out: str | os.PathLike) -> Path:
    """Where the output named ``out`` lives: a symbolic link is followed to what it points to.

    A command replaces the directory (or file) behind the link, and the link stays. Renamed over
    instead, the link itself would become the new output and the old one would stay behind under its
    own name; and two names of one output would take two locks, letting two writers in at once.
    """
    out = Path(out)
    return Path(os.path.realpath(out)) if out.is_symlink() else out


PATH_MAX = 4096  # bytes in a path, with its terminating NUL: Linux's
_PATH_ROOM = 128  # for the names an output holds (shards/shard-000000.safetensors, .NAME.tmp-PID-old)


@contextmanager
def utf8_name(path: str | os.PathLike) -> Iterator[str]:
    """A name of the file at ``path`` that a library taking only UTF-8 paths (safetensors' Rust
    loader, pyarrow) can open, for the block: ``path`` itself when it is UTF-8, else the file opened here and
    named by its descriptor (``/proc/self/fd/N``, or ``/dev/fd/N``). A run or trace directory whose
    name holds other bytes (a Latin-1 home directory) was otherwise called unreadable, to be made
    again. A missing file is the ``OSError`` of opening it."""
    text = os.fsdecode(path)
    if _is_utf8(text):
        yield text
        return
    fd = os.open(text, os.O_RDONLY)
    try:
        yield f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else f"/dev/fd/{fd}"
    finally:
        os.close(fd)


def _is_utf8(text: str) -> bool:
    """Whether ``text`` (a path as Python decodes it: other bytes become lone surrogates) is UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def refuse_unusable_path(out: str | os.PathLike, param: str = "out") -> None:
    """Raise :class:`InputError` for an output path no file system here can hold or no file of ours
    can name, before anything is made: bytes that are not UTF-8 (our JSON, Parquet and reports name
    paths in UTF-8), a name over :data:`NAME_MAX` bytes, or a path over :data:`PATH_MAX` less the
    room its files need. Each was a traceback from deep inside the first write."""
    text = os.fspath(out)
    if not _is_utf8(text):
        raise InputError(f"`{param}` {text} holds bytes that are not UTF-8, which the files naming it cannot "
                         f"hold: choose a `{param}` with a UTF-8 name")
    path = os.fsencode(os.path.abspath(text))
    longest = max(path.split(b"/"), key=len)
    if len(longest) > NAME_MAX:
        raise InputError(f"`{param}` holds a name of {len(longest):,} bytes ({longest[:24].decode('utf-8', 'replace')}…), "
                         f"over the {NAME_MAX} a file name may have: shorten it")
    if len(path) > PATH_MAX - _PATH_ROOM:
        raise InputError(f"`{param}` is {len(path):,} bytes long as an absolute path, over the "
                         f"{PATH_MAX - _PATH_ROOM:,} that leave its files room under the {PATH_MAX:,}-byte path "
                         f"limit (PATH_MAX): choose a shorter `{param}`")


@contextmanager
def hold_output_lock(out: str | os.PathLike) -> Iterator[Path]:
    """Hold ``out``'s :func:`output_lock` for the block, making its parent first; a parent that cannot
    be made or written is one :class:`StoreError` line, a path none can hold one :class:`InputError`
    (:func:`refuse_unusable_path`)."""
    refuse_unusable_path(out)
    out = output_path(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = output_lock(out).__enter__()
    except OSError as err:
        raise StoreError(f"cannot write next to {out} ({err.strerror}): choose another `out`") from None
    try:
        yield out
    finally:
        lock.__exit__()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FileLock:
    """An exclusive, non-blocking ``fcntl.flock`` on ``path``, holding the holder's pid.

    The OS drops the lock when the holder exits, however it exits; the file itself stays (empty of
    meaning once unlocked), unless ``transient``: then the holder removes it on release, and an
    acquirer that locked a file removed meanwhile tries again on the new one (so a lock file is
    left only by a killed holder, and the next holder takes it over). ``busy`` turns the holder's
    pid into the :class:`StoreError` message.
    """

    def __init__(self, path: str | os.PathLike, busy: Callable[[str], str], transient: bool = False):
        self.path = Path(path)
        self.busy = busy
        self.transient = transient
        self._fd: int | None = None

    def __enter__(self) -> "FileLock":
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise LockHeldError(self.busy(holder)) from None
            if not self.transient or _same_file(fd, self.path):
                break
            os.close(fd)  # its holder removed it while we opened it: lock the one at the path now
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._fd = fd
        return self

    def _open(self) -> int:
        """The lock file, opened without following a link: a link (or a hard link) planted at its name,
        in a directory others write (a shared mount), had us truncate and write the file it names. In
        the open itself: a check before it leaves the link time to appear."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as err:
            if err.errno != errno.ELOOP:
                raise
            raise StoreError(f"{self.path} is a symbolic link, not a lock file: remove the link (and check who "
                             "placed it), then rerun") from None
        info = os.fstat(fd)
        odd = ("not a regular file" if not stat.S_ISREG(info.st_mode)
               else "a hard link to another file" if info.st_nlink > 1  # 0 links: its last holder just removed it
               else None)
        if odd:
            os.close(fd)
            raise StoreError(f"{self.path} is not a lock file ({odd}): remove it (and check who placed it), then rerun")
        return fd

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            if self.transient:
                self.path.unlink(missing_ok=True)  # still locked: nobody can hold the file we remove
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    there = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
