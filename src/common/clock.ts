/**
 * Milliseconds on a clock that never steps: the wall clock at the process's start plus the time elapsed since then
 * on the monotonic clock. For this instance's intervals and deadlines (a wait, a throttle, a recheck); a step of the
 * wall clock (NTP, a VM resumed) made `Date.now()` differences negative or huge, and a check skipped or a wait cut
 * short. Times other processes read (a hold's end, a reservation's `expiresAt`) come from Redis' TIME instead.
 */
export function monotonicMs(): number {
  return performance.timeOrigin + performance.now();
}
