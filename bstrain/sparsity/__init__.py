"""Dynamic block sparsity: prune and regrow the blocks of block-sparse layers while training.

    policy = bstrain.sparsity.RigL(model, optimizer, every=100, fraction=0.3, stop=75_000)
    for x, y in batches:
        loss_fn(model(x), y).backward()
        optimizer.step(); optimizer.zero_grad()
        policy.step()                       # every 100 steps: a new layout for every sparse layer

Every ``every`` optimizer steps (until step ``stop``), each block-sparse layer of the model
(:class:`bstrain.nn.BlockSparseLinear`, :class:`bstrain.nn.BlockSparseConv2d`) drops
``round(fraction_at(step) · live blocks)`` of its live blocks (whole blocks, rounded per layer)
with the smallest weight norm and grows as many dead ones: at random (:class:`SET`) or those
whose dense gradient has the largest norm (:class:`RigL`, Evci et al. 2020; the dense gradient
X·dY of the step before the update is computed by hooks, on that step only). The share decays
from ``fraction`` to 0 by a cosine over [0, stop].

An update keeps everything consistent: the live-block count is unchanged, so the weight
Parameter keeps its shape and stays the optimizer's. Surviving blocks keep their values and
their optimizer state bit for bit, moved to their new place in the row-major block order. The
state that moves is every state tensor of the weight of shape (nnz, ...) whose other dims are
the weight's or 1: Adam's, AdamW's, NAdam's, RAdam's and SparseAdam's moments (AMSGrad's
``max_exp_avg_sq`` too), SGD's and RMSprop's ``momentum_buffer``, RMSprop's ``square_avg`` and
``grad_avg``, Adagrad's ``sum``, Adadelta's ``square_avg`` and ``acc_delta``, Adamax's
``exp_inf``, ASGD's ``ax``, Rprop's ``prev`` and ``step_size``, and Adafactor's factored
``row_var`` (nnz, bs, 1) and ``col_var`` (nnz, 1, bs). 0-dim tensors and Python numbers (step
counts, ASGD's ``eta`` and ``mu``, NAdam's ``mu_product``) are left alone. Grown blocks start at
zero, and their state at the optimizer's start value: Adagrad's ``initial_accumulator_value``,
Rprop's ``lr``, zero for the rest (see ``grown_moments``). Any other state of a managed weight (a
flattened or (bs, bs) tensor, a list; L-BFGS, whose state is flat vectors over all its
parameters) cannot follow the blocks and is refused with a ValueError naming the optimizer and
the key: at construction where the state exists, else at the update, before anything moves.

Layers that share one weight (``b.weight = a.weight``; a module registered under two names;
``ops`` pairs on one weight or on a module's weight) are updated once, as one: one new layout
for the weight, decided from its blocks (RigL: from the sum of their dense gradients, the
weight's dense gradient), the weight and its state moved once, and every layer that shares it
switched to that layout. Such layers must be of one kind (products or convolutions), block
size and layout, and a managed weight may not be a parameter of another module as well; other
ties are refused at construction with a ValueError naming both. Modules named in ``also`` (an
EMA copy of the model) get the same layouts and moves (their tied layers, if any, tied as the
model's). Each managed layer gets layout tables of its own, which an update rewrites in place
(see ``BlocksparseMatMul.set_layout``), so CUDA graphs and compiled graphs made after the policy
was built keep running the current layouts; where a layer's tables cannot take its new layout
(a block row or column longer than they hold; a block-diagonal convolution that now needs a
channel gather) it gets new ones, and the old ones are freed with the last op that holds them.
Build the policy before capturing or compiling: a graph made before it reads the layer's shared
tables, which updates never change. Under torch.distributed every rank makes the same decision:
the scores are averaged over ranks and the random draws are seeded by (seed, step).

The package, one file per job: ``policies`` (the classes: schedule, update, checkpoints; RigL's
hooks), ``groups`` (which layers a policy manages, tied weights, ``also`` copies), ``scores``
(RigL's dense gradients and block norms), ``growth`` (where blocks grow: greedy fill, augmenting
paths, balanced regrowth), ``remap`` (the block moves and the optimizer state that follows them)
and ``tables`` (switching a layer's layout and tables).
"""
from __future__ import annotations

from bstrain.sparsity.groups import sparse_layers
from bstrain.sparsity.policies import POLICIES, SET, DynamicSparsity, RigL

__all__ = ["DynamicSparsity", "SET", "RigL", "sparse_layers", "POLICIES"]
