//! node-svc: runs sandboxes on one host. Not built yet: see issue 3.
