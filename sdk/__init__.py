"""The Python SDK of Interlace's Semantic Variables (docs/semantic-variables.md).

    from interlace.sdk import Client, Input, Output, semantic_function

    @semantic_function
    def summarize(text: Input, summary: Output(max_tokens=64, transform={"strip": True})):
        '''Summarize: {{text}}
        Summary: {{summary}}'''

    with Client(model="smollm2") as client, client.session():
        print(summarize("...").get())

It speaks HTTP (httpx) and imports neither torch nor the engine.
"""

from .client import (DEFAULT_BASE_URL, AsyncClient, AsyncSession, Call, Client, SemanticVariable, Session,
                     current_session)
from .errors import (APIConnectionError, APITimeoutError, AuthenticationError, BadRequestError, ConflictError,
                     GetTimeoutError, InterlaceError, NoSessionError, NotFoundError, PermissionDeniedError,
                     ProducerFailedError, ServerError, SessionLimitError)
from .functions import SemanticFunction, semantic_function
from .spec import Input, Output

__all__ = [
    "Client", "AsyncClient", "Session", "AsyncSession", "SemanticVariable", "Call", "current_session",
    "DEFAULT_BASE_URL",
    "semantic_function", "SemanticFunction", "Input", "Output",
    "InterlaceError", "BadRequestError", "AuthenticationError", "PermissionDeniedError", "NotFoundError",
    "GetTimeoutError", "ConflictError", "SessionLimitError", "ProducerFailedError", "ServerError",
    "APIConnectionError", "APITimeoutError", "NoSessionError",
]
