"""Where the CPU kernels' library is cached, and whether a cached file may be loaded.

Loading a shared library runs its code in this process, so a cached library
is only as trustworthy as the people who can write it. A cache location is
trusted when the cache directory and the library file belong to this user
and neither is writable by group or others, and every directory above the
cache belongs to this user or root and is not writable by group or others
unless sticky (``/tmp``): otherwise another user could replace the file, or
rename the directory and put their own in its place, between the check and
the load. A trusted file must also be a whole library: loading one cut short
(a crash, a full disk) can kill the process with SIGBUS when the loader
touches a page past the file's end, instead of raising an error.
"""

from __future__ import annotations

import os
import pathlib
import stat
import struct
import sys


def cache_dir() -> pathlib.Path:
  """Where built libraries are kept (``$EMBEDLIB_CACHE_DIR`` or ``~/.cache/embedlib``)."""
  root = os.environ.get("EMBEDLIB_CACHE_DIR")
  if root:
    return pathlib.Path(root)
  xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(xdg) / "embedlib"


def _writable_by_others(mode: int) -> str | None:
  """``"group"``, ``"others"`` or ``"group and others"``: who else ``mode`` lets write."""
  who = [name for bit, name in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "others")) if mode & bit]
  return " and ".join(who) or None


def untrusted_dir(directory: pathlib.Path) -> str | None:
  """Why another user could change what ``directory`` holds, or None when no one can.

  Args:
    directory: an existing directory, already resolved (``os.path.realpath``).

  Returns:
    A sentence naming the directory and what is wrong with it, or None.
  """
  uid = os.getuid()
  why = _not_private(directory, os.stat(directory), stat.S_ISDIR, "directory")
  if why:
    return why
  for parent in directory.parents:
    st = os.stat(parent)
    if st.st_uid not in (uid, 0):
      return f"{parent}, above {directory}, is owned by uid {st.st_uid}, not by this user or root"
    who = _writable_by_others(st.st_mode)
    if who and not st.st_mode & stat.S_ISVTX:
      return (f"{parent}, above {directory}, is writable by {who} without the sticky bit "
              f"(mode {stat.S_IMODE(st.st_mode):04o})")
  return None


def untrusted_file(path: pathlib.Path) -> str | None:
  """Why another user could have written the file at ``path``, or None.

  The directory holding it is checked by `untrusted_dir`; a symbolic link is
  refused, since the file it points to may lie anywhere.
  """
  return _not_private(path, os.lstat(path), stat.S_ISREG, "regular file")


def _not_private(path, st, is_kind, kind: str) -> str | None:
  """Why ``path`` (its ``stat`` result ``st``) is not this user's alone, or None."""
  uid = os.getuid()
  if not is_kind(st.st_mode):
    return f"{path} is not a {kind}"
  if st.st_uid != uid:
    return f"{path} is owned by uid {st.st_uid}, not by this user (uid {uid})"
  who = _writable_by_others(st.st_mode)
  if who:
    return f"{path} is writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
  return None


# ELF header fields by class (32- or 64-bit): offsets of e_phoff, e_shoff and
# of e_phentsize, e_phnum, e_shentsize, e_shnum; the width of an offset; and,
# in a program header, the offsets of p_offset and p_filesz.
_ELF = {
    1: dict(phoff=0x1C, shoff=0x20, sizes=0x2A, word="I", p_offset=4, p_filesz=16),
    2: dict(phoff=0x20, shoff=0x28, sizes=0x36, word="Q", p_offset=8, p_filesz=32),
}


def incomplete(path: pathlib.Path) -> str | None:
  """Why the file at ``path`` is not a whole shared library, or None.

  An ELF file is whole when its program headers, every segment they describe
  and its section header table (which linkers put last) lie inside it. On
  other platforms only an empty file is caught.
  """
  data = pathlib.Path(path).read_bytes()
  if not data:
    return f"{path} is empty"
  if data[:4] != b"\x7fELF":
    return f"{path} is not an ELF file" if sys.platform.startswith("linux") else None
  layout = _ELF.get(data[4])
  order = {1: "<", 2: ">"}.get(data[5])
  if layout is None or order is None:
    return f"{path} has an unknown ELF class or byte order"
  word = order + layout["word"]
  try:
    (phoff,) = struct.unpack_from(word, data, layout["phoff"])
    (shoff,) = struct.unpack_from(word, data, layout["shoff"])
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", data, layout["sizes"])
    end = max(phoff + phnum * phentsize, shoff + shnum * shentsize)
    for i in range(phnum):
      header = phoff + i * phentsize
      (offset,) = struct.unpack_from(word, data, header + layout["p_offset"])
      (filesz,) = struct.unpack_from(word, data, header + layout["p_filesz"])
      end = max(end, offset + filesz)
  except struct.error:
    return f"{path} is cut short inside its ELF headers ({len(data)} bytes)"
  if end > len(data):
    return f"{path} is cut short ({len(data)} of {end} bytes)"
  return None


def install(built: pathlib.Path, target: pathlib.Path) -> None:
  """Moves the whole library ``built`` to ``target`` in one step.

  ``built`` must sit in ``target``'s directory. It is synced to disk before
  the rename and the directory after it, so that even after a power cut a
  reader finds either no library or a whole one, never an empty file under
  the final name.
  """
  reason = incomplete(built)
  if reason:
    raise RuntimeError(f"the compiler wrote an incomplete library: {reason}")
  os.chmod(built, 0o700)
  fd = os.open(built, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
  os.replace(built, target)
  fd = os.open(target.parent, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
