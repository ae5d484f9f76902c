"""The seed's README example, with torch in place of TensorFlow.

    python examples/seed_readme.py

Runs the Triton kernels on a GPU and the pure-PyTorch path on CPU.
"""
import numpy as np
import torch

from bstrain.ops.matmul import BlocksparseMatMul

hidden_size = 4096
block_size = 32
minibatch_size = 64
device = "cuda" if torch.cuda.is_available() else "cpu"

# Create a (random) sparsity pattern
sparsity = np.random.randint(2, size=(hidden_size // block_size, hidden_size // block_size))

# Initialize the sparse matrix multiplication object
bsmm = BlocksparseMatMul(sparsity, block_size=block_size)

# Initialize block-sparse weights (the seed's tf.get_variable used glorot-uniform)
bound = (6.0 / (2 * hidden_size * sparsity.mean())) ** 0.5
w = torch.nn.Parameter(torch.empty(bsmm.w_shape, device=device).uniform_(-bound, bound))

# Input
x = torch.ones(minibatch_size, hidden_size, device=device)

# Block-sparse matrix multiplication, with autograd
y = bsmm(x, w)
y.square().mean().backward()

print(y)
print(f"{bsmm}: y {tuple(y.shape)}, dW {tuple(w.grad.shape)} on {device}")
