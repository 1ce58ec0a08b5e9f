/** Commits in one batch at most: each is a subtransaction, and Postgres caches 64 per transaction. */
export const MAX_COMMITS_PER_BATCH = 32;

/**
 * Commit batches in flight at once. Fewer batches in flight make them larger, and a larger batch costs
 * Postgres less per commit (one transaction, one WAL flush): 88 µs of Postgres CPU per commit in batches
 * of 4, 57 in batches of 32 (measured by hand). Under the bench's confirm load, a service with 2 in flight
 * (DB_POOL_SIZE 4) did 15 % more confirms a second than one with 8 (DB_POOL_SIZE 16), at the same p99;
 * in `npm run bench` (DB_POOL_SIZE 16 in both) Postgres' CPU per confirm fell from 120 to 96 µs, and the
 * confirms a second rose 5 %, in runs 20 minutes apart. See docs/benchmarks.md.
 */
export const MAX_BATCHES_IN_FLIGHT = 2;
