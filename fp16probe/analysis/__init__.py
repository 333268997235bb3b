"""Analysis: pure functions from a Report to what-if tables, a recommendation and the CI gate's checks."""
