"""The one exception type for mistakes the user can fix: a config value, a data path, a busy or damaged run dir.

`python -m train` prints a UserError as one line (what is wrong and how to fix it) and exits with status 2;
any other exception is a bug and keeps its traceback. `--debug` shows the traceback of a UserError too.
"""

from __future__ import annotations


class UserError(Exception):
  """A problem in the user's config, data or run directory; the message names it and says how to fix it."""
