"""Unpickle a patched model in a fresh process (``torch.load`` of ``argv[1]``) and print its loss
on ``argv[2]`` token ids (comma-separated, batch 2): nothing imports teeny or registers anything
before the load (tests/test_patch_hf_stack.py)."""

import sys

import torch

model = torch.load(sys.argv[1], weights_only=False)
ids = torch.tensor([int(t) for t in sys.argv[2].split(",")]).view(2, -1)
print(model.config._attn_implementation, float(model(input_ids=ids, labels=ids).loss))
