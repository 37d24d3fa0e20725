"""Config files as YAML trees: PyYAML's safe loader, stricter where its leniency would hide a mistake."""

from __future__ import annotations

import typing
from typing import Any

import yaml

from train.errors import ConfigError


class _UniqueKeyLoader(yaml.SafeLoader):  # pylint: disable=too-many-ancestors
  """YAML's safe loader, refusing a key given twice in one mapping: PyYAML keeps the last one silently, so a second
  `run:` section dropped every setting of the first."""

  def construct_mapping(self, node, deep=False):
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
      if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base`: merged keys may be given again, that is its use
        continue
      key = self.construct_object(key_node, deep=True)
      if not isinstance(key, typing.Hashable):  # the safe loader's own error, below
        continue
      if key in seen:
        raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice, first on line {seen[key]}",
                                                key_node.start_mark)
      seen[key] = key_node.start_mark.line + 1
    return super().construct_mapping(node, deep=deep)


def read_yaml(path: str | None) -> dict[str, Any]:
  """The raw tree of a config file ({} for no file); a missing or malformed file (a key given twice too) is a
  one-line ConfigError."""
  raw: dict[str, Any] = {}
  if path:
    try:
      with open(path) as f:
        raw = yaml.load(f, Loader=_UniqueKeyLoader) or {}
    except OSError as e:
      raise ConfigError(f"cannot read config file {path!r}: {e.strerror}; see configs/ for examples") from e
    except UnicodeDecodeError as e:
      raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); is it a config file?") from e
    except yaml.YAMLError as e:
      mark = getattr(e, "problem_mark", None)
      where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else path
      what = " ".join(str(getattr(e, "problem", None) or e).split())
      raise ConfigError(f"{where}: malformed YAML ({what}); fix that line") from e
    if not isinstance(raw, dict):
      raise ConfigError(f"{path}: top level must be a mapping, got {type(raw).__name__}")
  return raw
