//! e2b-gateway: the E2B REST API and envd proxy. Not built yet: see issue 5.
