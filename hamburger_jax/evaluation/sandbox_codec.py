"""Plain-data codec between the sandboxed candidate and the trusted checker (checked_run.py).

Values cross the process boundary as Python literal text and are decoded by walking the syntax tree
with a whitelist, so whatever the candidate's process sends, the checker gets back only None, bool,
int, float, complex, str, bytes and lists, tuples, sets, frozensets and dicts of them: never an
object with behaviour of its own (an `__eq__` that always answers True cannot cross). Subclasses
(Counter, OrderedDict, namedtuple, str subclasses) cross as their builtin base; anything else is an
error that fails the check.

This file is also pasted verbatim into the two bootstraps (it imports only `ast` and `math`), so
keep it self-contained.
"""

import ast
import math

CODEC_MAX_DEPTH = 100


class CodecError(ValueError):
  """A value that cannot cross: an unsupported type, too deep, or text that is not plain data."""


def encode(value, depth=0):
  """`value` as literal text; raises CodecError for anything but plain builtin data."""
  if depth > CODEC_MAX_DEPTH:
    raise CodecError(f"value nested deeper than {CODEC_MAX_DEPTH} levels")
  if value is None or value is True or value is False:
    return repr(value)
  if isinstance(value, float):
    value = float(value)
    if math.isnan(value):
      return "float('nan')"
    if math.isinf(value):
      return "float('inf')" if value > 0 else "-float('inf')"
    return repr(value)
  if isinstance(value, int):  # after bool and float
    return repr(int(value))
  if isinstance(value, complex):
    return f"complex({encode(value.real, depth + 1)}, {encode(value.imag, depth + 1)})"
  if isinstance(value, str):
    return repr(str(value))
  if isinstance(value, (bytes, bytearray)):
    return repr(bytes(value))
  if isinstance(value, list):
    return "[" + ", ".join(encode(v, depth + 1) for v in value) + "]"
  if isinstance(value, tuple):
    items = [encode(v, depth + 1) for v in value]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{encode(k, depth + 1)}: {encode(v, depth + 1)}"
                           for k, v in value.items()) + "}"
  if isinstance(value, (set, frozenset)):
    kind = "frozenset" if isinstance(value, frozenset) else "set"
    return f"{kind}([" + ", ".join(encode(v, depth + 1) for v in value) + "])"
  raise CodecError(f"cannot pass a {type(value).__name__} between the sandbox and the checker "
                   "(plain data only: None, bool, numbers, str, bytes, list, tuple, dict, set)")


def decode(text):
  """The value of literal text written by encode(); raises CodecError for anything else."""
  try:
    tree = ast.parse(text, mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
    raise CodecError(f"not plain data: {type(e).__name__}") from None
  try:
    return _value(tree.body, 0)
  except TypeError as e:  # e.g. an unhashable set member or dict key
    raise CodecError(f"not plain data: {e}") from None


def _value(node, depth):
  if depth > CODEC_MAX_DEPTH:
    raise CodecError(f"value nested deeper than {CODEC_MAX_DEPTH} levels")
  if isinstance(node, ast.Constant) and (
      node.value is None or type(node.value) in (bool, int, float, complex, str, bytes)):
    return node.value
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    value = _value(node.operand, depth + 1)
    if type(value) in (int, float, complex):
      return -value
  if isinstance(node, ast.List):
    return [_value(v, depth + 1) for v in node.elts]
  if isinstance(node, ast.Tuple):
    return tuple(_value(v, depth + 1) for v in node.elts)
  if isinstance(node, ast.Dict) and None not in node.keys:
    return {_value(k, depth + 1): _value(v, depth + 1) for k, v in zip(node.keys, node.values)}
  if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.keywords):
    name, args = node.func.id, node.args
    if name == "float" and len(args) == 1 and isinstance(args[0], ast.Constant) and \
        args[0].value in ("nan", "inf"):
      return float(args[0].value)
    if name == "complex" and len(args) == 2:
      real, imag = _value(args[0], depth + 1), _value(args[1], depth + 1)
      if type(real) is float and type(imag) is float:
        return complex(real, imag)
    if name in ("set", "frozenset") and len(args) == 1 and isinstance(args[0], ast.List):
      items = [_value(v, depth + 1) for v in args[0].elts]
      return set(items) if name == "set" else frozenset(items)
  raise CodecError(f"not plain data: {type(node).__name__}")
