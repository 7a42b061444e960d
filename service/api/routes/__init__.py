"""One APIRouter per area; :data:`ROUTERS` in the order the app includes them."""

from service.api.routes import adapters, chat, health, model_control, models, openai, rerank, tokenize, ui

ROUTERS = (health.router, models.router, adapters.router, model_control.router, openai.router, chat.router,
           tokenize.router, rerank.router,
           tokenize.root_router, rerank.root_router, ui.router)

__all__ = ["ROUTERS"]
