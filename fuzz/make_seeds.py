"""Write each target's built-in seeds into fuzz/corpus/TARGET and its dictionary to fuzz/dict/TARGET.dict.

Run after changing a target's seeds or tokens: ``python fuzz/make_seeds.py [TARGET ...]``.
Seeds are named by their SHA-1 (existing files, such as minimized findings, are kept);
tests/test_fuzz_cli.py checks that every dictionary file matches its target's tokens.
"""

import hashlib
import os
import sys

from sandbox_fs.testing.fuzz import load_target, render_dictionary, target_names

HERE = os.path.dirname(os.path.abspath(__file__))

for name in sys.argv[1:] or target_names():
    target = load_target(name)
    corpus = os.path.join(HERE, "corpus", name)
    os.makedirs(corpus, exist_ok=True)
    for data in target.seeds():
        path = os.path.join(corpus, "seed-" + hashlib.sha1(data).hexdigest()[:12])
        if not os.path.exists(path):
            with open(path, "wb") as fh:
                fh.write(data)
    os.makedirs(os.path.join(HERE, "dict"), exist_ok=True)
    with open(os.path.join(HERE, "dict", f"{name}.dict"), "w") as fh:
        fh.write(render_dictionary(target.tokens))
