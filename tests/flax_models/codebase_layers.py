"""Projections written the way two large JAX codebases write them, for the conversion tests
(test_codebase_conversion.py, sharding/codebase_worker.py).

T5X (google-research/t5x): ``standard_logical_axis_rules`` of t5x/partitioning.py, and
``DenseGeneral`` of t5x/examples/t5/layers.py: a 2-d float32 parameter created with
``flax.linen.partitioning.param_with_axes`` (under axis rules and a mesh, a
sharding-constrained copy), cast to the computation dtype (``jnp.asarray(kernel,
dtype)``), reshaped to N-d and multiplied by an N-d ``lax.dot_general``.

MaxText (AI-Hypercomputer/maxtext, MaxText/layers/linears.py): ``DenseGeneral`` as a linen
module (an N-d parameter through ``nn.with_logical_partitioning``, cast with
``jnp.asarray``, ``_compute_dot_general``) and as an NNX module (an ``nnx.Param`` with its
logical axes, ``self.kernel[...]`` cast with ``jnp.asarray``).

Each layer takes ``fp8``: None (the layer as the codebase writes it) or a recipe, for the
hand-written FP8 layer the conversion must equal: the same code with its one
``lax.dot_general`` replaced by jax_fp8's FP8 GEMM holding the weight's state under the
name the conversion gives it (``kernel_fp8``).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from jax import lax

import jax_fp8.flax as fp8_linen
from jax_fp8.flax import nnx as fp8_nnx

param_with_axes = nn_partitioning.param_with_axes
with_sharding_constraint = nn_partitioning.with_sharding_constraint


# ----------------------------------------------------------------------------- T5X

def standard_logical_axis_rules(activation_partitioning_dims: int = 1,
                                parameter_partitioning_dims: int = 1,
                                additional_rules=None):
    """t5x/partitioning.py's default sharding rules in terms of logical axis names."""
    if activation_partitioning_dims == 1 and parameter_partitioning_dims == 1:
        rules = [
            ('batch', 'data'),
            ('vocab', 'model'),
            ('embed', None),
            ('mlp', 'model'),
            ('heads', 'model'),
            ('kv', None),
            ('joined_kv', 'model'),  # joined heads+kv dim in 2D attn param layouts
        ]
    elif activation_partitioning_dims == 2 and parameter_partitioning_dims == 1:
        rules = [
            ('batch', 'data'),
            ('vocab', 'model'),
            ('mlp', 'model'),
            ('heads', 'model'),
            ('kv', None),
            ('joined_kv', 'model'),
            ('embed', 'model'),
        ]
    elif activation_partitioning_dims == 1 and parameter_partitioning_dims == 2:
        rules = [
            ('batch', 'data'),
            ('vocab', 'model'),
            ('mlp', 'model'),
            ('heads', 'model'),
            ('kv', None),
            ('joined_kv', 'model'),
            ('embed', 'data'),
        ]
    elif activation_partitioning_dims == 2 and parameter_partitioning_dims == 2:
        rules = [
            ('batch', 'data'),
            ('vocab', 'model'),
            ('mlp', 'model'),
            ('heads', 'model'),
            ('kv', None),
            ('joined_kv', 'model'),
            ('embed', 'model'),
            ('embed', 'data'),
        ]
    else:
        raise ValueError(
            f'`activation_partitioning_dims` = {activation_partitioning_dims} '
            f'`parameter_partitioning_dims` = {parameter_partitioning_dims} '
            'is not supported.')

    # Add the common rules for the replicated logical axes names.
    replicated_rules = [
        ('relpos_buckets', None),
        ('abspos_buckets', None),
        ('length', None),
        ('layers', None),
        ('stack', None),
        ('mlp_activations', None),
    ]
    rules.extend(replicated_rules)

    if additional_rules:
        rules.extend(additional_rules)

    return rules


def _normalize_axes(axes: Iterable[int], ndim: int) -> tuple[int, ...]:
    # A tuple by convention. len(axes_tuple) then also gives the rank efficiently.
    return tuple(ax if ax >= 0 else ndim + ax for ax in axes)


def _canonicalize_tuple(x):
    if isinstance(x, Iterable):
        return tuple(x)
    else:
        return (x,)


def _dot_general(fp8, inputs, kernel, dimension_numbers):
    """The layer's one GEMM: ``lax.dot_general`` as the codebase calls it, or (``fp8`` a
    recipe) jax_fp8's FP8 GEMM with the weight's state, ``kernel_fp8``."""
    if fp8 is None:
        return lax.dot_general(inputs, kernel, dimension_numbers)
    return fp8_linen.Fp8DotGeneral(recipe=fp8, name='kernel_fp8')(inputs, kernel,
                                                                   dimension_numbers)


class T5xDenseGeneral(nn.Module):
    """A linear transformation (without bias) with flexible axes (T5X's DenseGeneral).

    Attributes:
      features: tuple with numbers of output features.
      axis: tuple with axes to apply the transformation on.
      dtype: the dtype of the computation (default: float32).
      kernel_init: initializer function for the weight matrix.
    """
    features: Any
    axis: Any = -1
    dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.variance_scaling(1.0, 'fan_in', 'truncated_normal')
    kernel_axes: tuple[str, ...] = ()
    fp8: Any = None

    @nn.compact
    def __call__(self, inputs):
        features = _canonicalize_tuple(self.features)
        axis = _canonicalize_tuple(self.axis)

        inputs = jnp.asarray(inputs, self.dtype)
        axis = _normalize_axes(axis, inputs.ndim)

        kernel_shape = tuple([inputs.shape[ax] for ax in axis]) + features
        kernel_param_shape = (np.prod([inputs.shape[ax] for ax in axis]),
                              np.prod(features))
        kernel = param_with_axes(
            'kernel',
            self.kernel_init,
            kernel_param_shape,
            jnp.float32,
            axes=self.kernel_axes)
        kernel = jnp.asarray(kernel, self.dtype)
        kernel = jnp.reshape(kernel, kernel_shape)

        contract_ind = tuple(range(0, len(axis)))
        return _dot_general(self.fp8, inputs, kernel, ((axis, contract_ind), ((), ())))


class T5xBlock(nn.Module):
    """An encoder block of T5X's layers: query / key / value / out projections
    (``joined_kv`` kernels, the out projection contracting heads and head dims), the
    attention of two activations, and the MLP's wi / wo; activations constrained with
    T5X's logical axes."""
    num_heads: int = 2
    head_dim: int = 16
    mlp_dim: int = 64
    dtype: Any = jnp.bfloat16
    fp8: Any = None

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(T5xDenseGeneral, dtype=self.dtype, fp8=self.fp8)
        x = with_sharding_constraint(x, ('batch', 'length', 'embed'))
        q, k, v = (dense(features=(self.num_heads, self.head_dim),
                         kernel_axes=('embed', 'joined_kv'), name=name)(x)
                   for name in ('query', 'key', 'value'))
        scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(self.head_dim)
        weights = nn.softmax(scores.astype(jnp.float32)).astype(self.dtype)
        o = jnp.einsum('bhqk,bkhd->bqhd', weights, v)
        x = x + dense(features=x.shape[-1], axis=(-2, -1), kernel_axes=('joined_kv', 'embed'),
                      name='out')(o)
        h = dense(features=self.mlp_dim, kernel_axes=('embed', 'mlp'), name='wi')(x)
        h = with_sharding_constraint(nn.relu(h), ('batch', 'length', 'mlp'))
        return x + dense(features=x.shape[-1], kernel_axes=('mlp', 'embed'), name='wo')(h)


T5X_PROJECTIONS = 6


# ------------------------------------------------------------------------- MaxText

def _compute_dot_general(inputs, kernel, kernel_axes, axis, contract_ind, matmul_precision,
                         fp8):
    """Computes a dot_general operation (MaxText's, its AQT branch replaced by ``fp8``)."""
    del kernel_axes
    matmul_precision = lax.Precision(matmul_precision)
    if fp8 is not None:
        return fp8(inputs, kernel, ((axis, contract_ind), ((), ())), precision=None)
    return lax.dot_general(inputs, kernel, ((axis, contract_ind), ((), ())),
                           precision=matmul_precision)


def nd_dense_init(scale, mode, distribution):
    """MaxText's initializer for N-d kernels (in and out axes given)."""
    def init_fn(key, shape, dtype, in_axis, out_axis):
        fn = nn.initializers.variance_scaling(scale, mode, distribution, in_axis, out_axis)
        return fn(key, shape, dtype)
    return init_fn


class MaxTextDenseGeneral(nn.Module):
    """A linear transformation with flexible axes (MaxText's linen DenseGeneral)."""
    features: Any
    axis: Any = -1
    weight_dtype: Any = jnp.float32
    dtype: Any = jnp.float32
    kernel_init: Any = nd_dense_init(1.0, 'fan_in', 'truncated_normal')
    kernel_axes: tuple = ()
    matmul_precision: str = 'default'
    fp8: Any = None

    @nn.compact
    def __call__(self, inputs):
        features = _canonicalize_tuple(self.features)
        axis = _canonicalize_tuple(self.axis)

        inputs = jnp.asarray(inputs, self.dtype)
        axis = _normalize_axes(axis, inputs.ndim)

        kernel_shape = tuple(inputs.shape[ax] for ax in axis) + features
        kernel_in_axis = np.arange(len(axis))
        kernel_out_axis = np.arange(len(axis), len(axis) + len(features))
        kernel = self.param(
            'kernel',
            nn.with_logical_partitioning(self.kernel_init, self.kernel_axes),
            kernel_shape,
            self.weight_dtype,
            kernel_in_axis,
            kernel_out_axis,
        )
        kernel = jnp.asarray(kernel, self.dtype)
        contract_ind = tuple(range(0, len(axis)))
        fp8 = None if self.fp8 is None else fp8_linen.Fp8DotGeneral(recipe=self.fp8,
                                                                     name='kernel_fp8')
        return _compute_dot_general(inputs, kernel, self.kernel_axes, axis, contract_ind,
                                    self.matmul_precision, fp8)


class MaxTextMlpBlock(nn.Module):
    """MaxText's MLP block (linen): a fused wi of two activations ((embed,
    num_activations, mlp) kernel), gated, and wo; activations constrained with MaxText's
    logical axes."""
    intermediate_dim: int = 64
    activations: tuple = ('gelu', 'linear')
    dtype: Any = jnp.bfloat16
    fp8: Any = None

    @nn.compact
    def __call__(self, inputs):
        x = MaxTextDenseGeneral(
            (len(self.activations), self.intermediate_dim), dtype=self.dtype,
            kernel_axes=('embed', 'num_activations', 'mlp'), name='wi', fp8=self.fp8)(inputs)
        activations = []
        for idx, act_fn in enumerate(self.activations):
            fn = (lambda y: y) if act_fn == 'linear' else getattr(nn, act_fn)
            activations.append(fn(x[:, :, idx, ...]))
        x = functools.reduce(operator.mul, activations).astype(self.dtype)
        x = nn.with_logical_constraint(x, ('activation_batch', 'activation_length',
                                           'activation_mlp'))
        return MaxTextDenseGeneral(inputs.shape[-1], dtype=self.dtype,
                                   kernel_axes=('mlp', 'embed'), name='wo',
                                   fp8=self.fp8)(x)


MAXTEXT_PROJECTIONS = 2
# MaxText's logical axes, mapped onto a data x model mesh.
MAXTEXT_RULES = (('activation_batch', 'data'), ('activation_length', None),
                 ('activation_mlp', 'model'), ('embed', None), ('num_activations', None),
                 ('mlp', 'model'))


class NnxDenseGeneral(nnx.Module):
    """A linear transformation with flexible axes (MaxText's NNX DenseGeneral)."""

    def __init__(self, in_features_shape, out_features_shape, axis=-1,
                 weight_dtype=jnp.float32, dtype=jnp.float32,
                 kernel_init=None, kernel_axes=(), matmul_precision='default', fp8=None, *,
                 rngs):
        if kernel_init is None:
            kernel_init = nd_dense_init(1.0, 'fan_in', 'truncated_normal')
        self.in_features_shape = _canonicalize_tuple(in_features_shape)
        self.out_features_shape = _canonicalize_tuple(out_features_shape)
        self.axis = _canonicalize_tuple(axis)
        self.weight_dtype = weight_dtype
        self.dtype = dtype
        self.kernel_axes = kernel_axes
        self.matmul_precision = matmul_precision

        kernel_shape = self.in_features_shape + self.out_features_shape
        kernel_in_axis = np.arange(len(self.axis))
        kernel_out_axis = np.arange(len(self.axis),
                                    len(self.axis) + len(self.out_features_shape))
        self.kernel = nnx.Param(
            kernel_init(rngs.params(), kernel_shape, self.weight_dtype, kernel_in_axis,
                        kernel_out_axis),
            out_sharding=self.kernel_axes,
        )
        self.hand_written_fp8 = fp8 is not None
        if fp8 is not None:
            self.kernel_fp8 = fp8_nnx.Fp8DotGeneral(fp8)

    def __call__(self, inputs):
        inputs = jnp.asarray(inputs, self.dtype)
        norm_axis = _normalize_axes(self.axis, inputs.ndim)
        kernel = self.kernel[...]
        kernel = jnp.asarray(kernel, self.dtype)
        contract_ind = tuple(range(0, len(self.axis)))
        return _compute_dot_general(inputs, kernel, self.kernel_axes, norm_axis,
                                    contract_ind, self.matmul_precision,
                                    self.kernel_fp8 if self.hand_written_fp8 else None)


class NnxMlpBlock(nnx.Module):
    """MaxText's NNX MLP block: fused wi, gated, wo."""

    def __init__(self, in_features, intermediate_dim=64, activations=('gelu', 'linear'),
                 dtype=jnp.bfloat16, fp8=None, *, rngs):
        self.activations = activations
        self.dtype = dtype
        self.wi = NnxDenseGeneral(in_features, (len(activations), intermediate_dim),
                                  dtype=dtype, kernel_axes=('embed', 'num_activations', 'mlp'),
                                  fp8=fp8, rngs=rngs)
        self.wo = NnxDenseGeneral(intermediate_dim, in_features, dtype=dtype,
                                  kernel_axes=('mlp', 'embed'), fp8=fp8, rngs=rngs)

    def __call__(self, inputs):
        x = self.wi(inputs)
        activations = []
        for idx, act_fn in enumerate(self.activations):
            fn = (lambda y: y) if act_fn == 'linear' else getattr(nn, act_fn)
            activations.append(fn(x[:, :, idx, ...]))
        x = functools.reduce(operator.mul, activations).astype(self.dtype)
        return self.wo(x)
