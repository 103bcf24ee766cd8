"""A data format shardax does not ship, added the way a user adds one: this one file.

``qa`` reads records ``{"question": ..., "answer": ...}``: each is one example, the question and
its answer joined as they are, the loss on the answer's tokens alone. The rest (whole examples
packed into rows, the masked loss, evaluation, the closing sample answering a held-out question)
is a conversation's: ``Conversations``. Importing the module registers it; ``shardax train
--format tiny_format:QuestionAnswer`` imports it.
"""

from shardax.data.formats.conversations import Conversations
from shardax.data.registry import register_format
from shardax.errors import UsageError


class QuestionAnswer(Conversations):
    name, what, example, learned = "qa", "questions and answers", "question", "the answers'"

    @staticmethod
    def recognises(record, field):
        return isinstance(record, dict) and {"question", "answer"} <= set(record)

    @staticmethod
    def sequences(record, template, where):
        question, answer = record.get("question"), record.get("answer")
        if not isinstance(question, str) or not isinstance(answer, str) or not answer.strip():
            raise UsageError(f"{where}: give a question and an answer, two strings (the answer not empty)")
        return [(question + answer, [(len(question), len(question) + len(answer))])]


register_format(QuestionAnswer)
