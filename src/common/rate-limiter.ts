import { monotonicMs } from './clock.js';

/** Token bucket per client key, in process memory: each instance limits what it serves. */
export class RateLimiter {
  private readonly buckets = new Map<string, { tokens: number; at: number }>();
  private lastPrune = 0;

  constructor(
    private readonly perSecond: number,
    private readonly burst: number,
    private readonly clock: () => number = monotonicMs,
  ) {}

  take(key: string): boolean {
    const now = this.clock();
    if (now - this.lastPrune > 60_000) this.prune(now);
    const bucket = this.buckets.get(key) ?? { tokens: this.burst, at: now };
    bucket.tokens = Math.min(this.burst, bucket.tokens + ((now - bucket.at) / 1000) * this.perSecond);
    bucket.at = now;
    this.buckets.set(key, bucket);
    if (bucket.tokens < 1) return false;
    bucket.tokens -= 1;
    return true;
  }

  private prune(now: number): void {
    this.lastPrune = now;
    for (const [key, bucket] of this.buckets) {
      if (now - bucket.at > 60_000) this.buckets.delete(key);
    }
  }
}
