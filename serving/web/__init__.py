"""The operator's pages of `gpufail serve` (docs/serving.md, "The operator's pages"): the
fleet at a glance with the at-risk table (`/`), a node (`/nodes/{node}`), and the publish
audit with the circuit breaker (`/actions`). Server-rendered HTML; the templates, the style
sheet and the little JavaScript ship in this package."""

from serving.web.routes import OperatorPages, operator_pages

__all__ = ["OperatorPages", "operator_pages"]
