"""The HTTP routes and what they share: intake, OpenAPI, pages, middleware."""
