"""Tensor parallelism read off what a model computes: Megatron's layout for weights nobody annotated.

The loss is traced once on abstract values (``jax.make_jaxpr``: no FLOP is spent) and every
dimension of every value in the program is tied to the dimensions it must share a layout with:
an element-wise op ties its operands' dimensions to its result's, a matrix product ties the
contracted dimension of one operand to the other's and the free ones to its result, a reshape
ties a merged dimension to its major part, and so on through nested calls, remat, scans and
branches. What ends up tied together is one *dimension class*. A class is the hidden
dimension of a Megatron pair when a weight's matrix product *produces* it from an activation
(the column half: attention heads, MLP hidden, conv channels), a later weight *consumes* it by
contracting it with an activation (the row half), and nothing in between reduces over it or
cuts it (no norm, softmax, slice or concatenation): then both weights split it over ``model``
and the activations between them stay split with no communication. A class a weight produces
or looks rows up in (an embedding) that no weight consumes is an output head's or embedding's
vocabulary, split over ``model`` as well. Each weight takes ``model`` on at most one
dimension, the largest classes first; every other weight stays whole, with the reason.

Grouped-query attention repeats each key/value head for several query heads; when the kv
heads do not divide over ``model`` the keys and values stay whole (each device computes all
of them) while the query heads and the output projection split.

A mixture of experts written with stacked weights (``einsum("ebcd,edf->ebcf", tokens, w)``, as
GShard, Switch and MaxText's dense path write it) applies each expert's slice of a weight to its
own tokens: the experts' dimension is a *batch* dimension of that product, and no later weight
reads across it (the router's weights combine the experts' outputs). That class is the
``expert`` dimension, split over the strategy's expert axis (``ep``, ``fsdp_ep``, ``ep_tp``);
each expert's hidden dimension is still a Megatron pair for ``model``. A model that slices its
stacked weights one expert at a time keeps them whole, with the reason.
"""

from shardax.sharding.derive.decide import Derived, derive_split

__all__ = ["Derived", "derive_split"]
