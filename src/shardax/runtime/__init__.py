"""What runs inside a step when a model is cut over more axes than its batch.

``pipeline``: a stack of layers split into stages, microbatches flowing through them.
``context``: sequences split over devices, attention gathering or passing the other shares.

Nothing here reads ambient state: the public blocks (``shardax.blocks.LayerStack`` and
``shardax.blocks.Attention``) are told how to run by ``parallelize`` and pass it in.
"""
