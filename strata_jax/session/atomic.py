"""Atomic replacement of a session directory, recovery from a save killed half-way, and the
clean-up of what killed saves leave behind.

A save writes a complete checkpoint into a temporary directory beside `path`, verifies and
fsyncs it, then swaps it in: one atomic `renameat2(RENAME_EXCHANGE)` (through ctypes) where the
filesystem has it, else rename-old-to-backup, rename-new-into-place, delete backup. A reader
that finds `path` missing but the backup present (a save killed between the two renames)
restores the backup.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import uuid
from collections.abc import Callable

from strata_jax.errors import SessionError
from strata_jax.session.schema import MAGIC

TMP_INFIX = ".strata-tmp."      # `<path>.strata-tmp.<pid>.<hex>`: a save (or erase) in flight
BACKUP_SUFFIX = ".strata-old"   # `<path>.strata-old`: the previous session during a swap

# Test seam: called with the name of each step of a save ("written", "exchanged", "backed_up",
# "renamed", "cleaned"), so a test can kill the process exactly there.
step_hook: Callable[[str], None] | None = None


def recover(path: str) -> str:
  """Undoes a save killed between its two renames; returns where the session now lives."""
  backup = path + BACKUP_SUFFIX
  if os.path.lexists(path) or not os.path.isdir(backup):
    return path
  try:
    os.rename(backup, path)
    fsync_dir(os.path.dirname(path))
    return path
  except OSError:
    return backup   # read-only place: read the backup where it is


def check_replaceable(path: str):
  """Only a session (or an empty directory) may be replaced or erased: never user data."""
  if not os.path.lexists(path):
    return
  if os.path.isdir(path) and not os.path.islink(path):
    if not os.listdir(path):
      return
    try:   # a raw look, so that a session with a damaged header can still be replaced
      with open(os.path.join(path, "_CHECKPOINT_METADATA"), "rb") as f:
        if f'"{MAGIC}"'.encode() in f.read(1 << 20):
          return
    except OSError:
      pass
  raise SessionError(f"{path}: refusing to overwrite or erase it: it exists and is not a "
                     f"session directory")


def tmp_name(path: str) -> str:
  return f"{path}{TMP_INFIX}{os.getpid()}.{uuid.uuid4().hex[:12]}"


def sweep(path: str):
  """Removes leftovers of saves killed earlier: temp dirs of dead processes, a stale backup."""
  parent, base = os.path.split(path)
  prefix = base + TMP_INFIX
  try:
    names = os.listdir(parent)
  except OSError:
    return
  for name in names:
    if name.startswith(prefix):
      pid = name[len(prefix):].split(".")[0]
      if pid.isdigit() and not _alive(int(pid)):
        rmtree_quiet(os.path.join(parent, name))
  if os.path.lexists(path) and os.path.isdir(path + BACKUP_SUFFIX):
    rmtree_quiet(path + BACKUP_SUFFIX)


def _alive(pid: int) -> bool:
  if pid == os.getpid():
    return False   # our own leftovers: this process holds the lock, none is in flight
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True
  return True


def replace(tmp: str, path: str):
  """Puts the finished checkpoint `tmp` at `path`, replacing the session there (if any)."""
  parent = os.path.dirname(path)
  if not os.path.lexists(path):
    os.rename(tmp, path)
    step("renamed")
    fsync_dir(parent)
    return
  if _exchange(tmp, path):
    # `path` is now the new session, `tmp` holds the old one.
    step("exchanged")
    fsync_dir(parent)
    rmtree_quiet(tmp)
    step("cleaned")
    return
  backup = path + BACKUP_SUFFIX
  os.rename(path, backup)
  step("backed_up")
  try:
    os.rename(tmp, path)
  except OSError:
    os.rename(backup, path)   # put the old session back before reporting the failure
    raise
  step("renamed")
  fsync_dir(parent)
  rmtree_quiet(backup)
  step("cleaned")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
# Tests switch it off to cover the backup-rename fallback.
use_exchange = sys.platform.startswith("linux")


def _exchange(a: str, b: str) -> bool:
  """Atomically swaps two paths with renameat2(RENAME_EXCHANGE); False where unsupported."""
  global use_exchange
  if not use_exchange:
    return False
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.renameat2
  except (OSError, AttributeError):
    use_exchange = False
    return False
  fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  err = ctypes.get_errno()
  if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
    return False   # this filesystem cannot: use the backup-rename path
  raise OSError(err, f"renameat2 exchange failed: {os.strerror(err)}")


def fsync_tree(root: str):
  for dirpath, _, files in os.walk(root):
    for f in files:
      fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    fsync_dir(dirpath)


def fsync_dir(d: str):
  try:
    fd = os.open(d, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass   # some filesystems refuse fsync on directories
  finally:
    os.close(fd)


def rmtree_quiet(p: str):
  shutil.rmtree(p, ignore_errors=True)


def du(root: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)


def step(name: str):
  if step_hook is not None:
    step_hook(name)
