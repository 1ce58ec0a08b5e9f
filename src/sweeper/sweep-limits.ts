/**
 * How the sweeper cuts its work. One sweep call runs as one Lua script, and Redis serves nothing else
 * while it runs: 30-70 µs per expired reservation, measured on a 2-core machine. A batch of 500 kept
 * every other request waiting up to about 20 ms, which showed in the reserve p99 of respool and of the
 * bench's ceiling alike. Batches of 100 keep that wait near 5 ms; more batches a tick keep the expiry
 * capacity where it was (20,000 reservations a pool a tick, 80,000/s at the default 250 ms interval).
 */
export const SWEEP_BATCH = 100;
/**
 * A batch also ends once the items it freed took this many index writes (one per item, one per attribute,
 * one for a group): a reservation may hold 100 items of 32 attributes each, 3,300 writes, so 100 such
 * reservations in one call would hold Redis for a second or more. Batches of plain 3-item reservations
 * (300 writes) never reach it.
 */
export const SWEEP_WORK_BUDGET = 2_000;
export const MAX_BATCHES_PER_TICK = 200;
/**
 * Pools swept at once by one instance. A pass over the pools one after the other costs a Redis round trip per
 * pool at least, so with hundreds of pools (and round trips slowed by load) a pass alone outgrew the 2 s in
 * which an expired item must be free again. Side by side, ioredis sends the calls together; each is one short
 * script (SWEEP_BATCH, SWEEP_WORK_BUDGET), so Redis still serves other requests between them.
 */
export const SWEEP_CONCURRENCY = 16;
