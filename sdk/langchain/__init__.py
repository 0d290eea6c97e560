"""LangChain integration: ``ChatInterlace``, a LangChain chat model over
Interlace's OpenAI-compatible endpoint, and ``to_semantic``, which runs an
existing LCEL chain as one Semantic Variable DAG on the server.

Needs ``langchain-core``: ``pip install "interlace-client[langchain]"`` (``./sdk[langchain]`` from a clone).
"""

try:
    import langchain_core  # noqa: F401
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("interlace.sdk.langchain needs langchain-core: pip install 'interlace-client[langchain]'") from e

from .chat_model import ChatInterlace
from .semantic_chain import ConversionError, SemanticChain, to_semantic

__all__ = ["ChatInterlace", "ConversionError", "SemanticChain", "to_semantic"]
