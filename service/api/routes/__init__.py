"""One APIRouter per area; :data:`ROUTERS` in the order the app includes them."""

from service.api.routes import adapters, chat, health, model_control, models, openai, tokenize, ui

ROUTERS = (health.router, models.router, adapters.router, model_control.router, openai.router, chat.router,
           tokenize.router,
           tokenize.root_router, ui.router)

__all__ = ["ROUTERS"]
