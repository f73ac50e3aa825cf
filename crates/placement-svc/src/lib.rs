//! placement-svc: chooses a node for each sandbox. Not built yet: see issue 4.
