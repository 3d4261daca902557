"""``python -m shardzoo.models.hf --markdown``: the README's list of families, from the registry."""

import sys

from shardzoo.models.hf.registry import families_markdown

if sys.argv[1:] != ["--markdown"]:
    sys.exit("usage: python -m shardzoo.models.hf --markdown")
print(families_markdown(), end="")
