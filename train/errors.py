"""The one exception type for problems the user can fix: a config value, a data path, a busy or damaged run dir, a
full disk.

`python -m train` prints a UserError as one line (what is wrong and how to fix it) and exits with status 2;
any other exception is a bug and keeps its traceback. `--debug` shows the traceback of a UserError too.
"""

from __future__ import annotations

import os
import tempfile


class UserError(Exception):
  """A problem in the user's config, data or run directory; the message names it and says how to fix it."""


class ConfigError(UserError, ValueError):
  """A config file, key or value that cannot be right; raised while loading, before any data or model work."""


def check_writable_dir(path: str | os.PathLike, what: str) -> None:
  """Makes directory `path` if missing and raises a UserError naming `what` if that cannot be done or nothing
  can be written there (a file in the way, no permission), before any work is done."""
  try:
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
      pass
  except OSError as err:
    raise UserError(f"{what}={os.fspath(path)!r}: cannot use it as a directory ({err.strerror or err}); "
                    f"choose another") from err
