"""What proves the kernels right: the op registry (``registry``: each op's PyTorch reference and
tolerance rule), its samples (``samples``: one module per op family), the facts computed by
lowering them (``facts``) and central finite differences (``gradcheck``)."""
