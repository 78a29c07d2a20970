"""Small trained TransformerLens models shipped inside the package, loadable offline.

``load(name)`` gives a ``TransformerBridge`` on TransformerLens 4.x and a ``HookedTransformer``
on 3.x, tokenizer included; ``names()`` lists what there is. Each model folder under
``tl_dynamics/zoo/models/`` has a ``MODEL_CARD.md`` with its training data, losses and head
structure; ``python -m tl_dynamics.zoo.train NAME`` rebuilds it. ``untrained(name)`` is the same
configuration at initialisation (the control), ``regression_sequences(n, seed)`` the task of
``regression-2l``. ``export_gpt2("code-2l", folder)`` writes
the language model as a Hugging Face GPT-2 folder for ``TransformerBridge.boot_transformers``.

>>> from tl_dynamics import zoo
>>> model = zoo.load("code-2l")
>>> model.to_str_tokens("def f(x):")[:3]
['<|endoftext|>', 'def', ' f']
"""

from tl_dynamics.zoo._export import export_gpt2
from tl_dynamics.zoo._load import load, names, regression_sequences, untrained

__all__ = ["export_gpt2", "load", "names", "regression_sequences", "untrained"]
