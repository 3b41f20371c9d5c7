"""Registered ops, one module per op family: fake impl, autograd function, public function and
plain PyTorch reference (``<op>_ref``) side by side."""
