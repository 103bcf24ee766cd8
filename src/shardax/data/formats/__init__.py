"""The data formats shardax ships, each registered by its module as a user registers theirs
(``shardax.data.registry.register_format``): ``text`` (text files' bytes held in memory, the
default run without a tokenizer), ``documents`` (token shards of ``shardax prepare``, packed),
``conversations`` (the assistant's tokens learned) and ``preferences`` (pairs, trained with DPO).

Another format is one module: a ``DataFormat`` (most simply a subclass of
``conversations.Conversations`` changing what differs) and a ``register_format(...)`` call,
imported before its data is read, or named ``--format module:Class``.
"""

# in the order they register in: a record is offered to the latest registered first
from shardax.data.formats import text, documents, conversations, preferences  # noqa: I001

__all__ = ["conversations", "documents", "preferences", "text"]
