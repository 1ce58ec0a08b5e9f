import { Instance } from './cluster.js';

export interface Exchange {
  client: string;
  instance: string;
  op: string;
  path: string;
  body?: unknown;
  sentAt: number;
  doneAt: number;
  status: number; // 0 = network error (instance killed), -1 = no answer before the timeout
  answer?: any;
  /** For confirm/complete: the reservation's expiresAt as the client last knew it. */
  expiresAt?: number;
  /** False when an extension whose answer was lost (503, no answer) may have moved expiresAt later than that. */
  expiryKnown?: boolean;
  reservationCreatedAt?: number;
  /** The request's Idempotency-Key header, if it sent one. */
  idempotencyKey?: string;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const pick = <T>(xs: T[]): T => xs[Math.floor(Math.random() * xs.length)];
const between = (lo: number, hi: number) => lo + Math.random() * (hi - lo);

/** Talks to the instances and keeps every request and answer, for the checker. */
export class Traffic {
  readonly log: Exchange[] = [];
  stopped = false;

  constructor(
    readonly instances: Instance[],
    readonly timeoutMs: number,
  ) {}

  live(except?: Instance): Instance {
    const up = this.instances.filter((i) => i.state === 'up' && i !== except);
    if (up.length) return pick(up);
    // None but `except` (or none at all, while the suite shuts down): the request then fails as it would.
    const any = this.instances.filter((i) => i.state === 'up');
    return pick(any.length ? any : this.instances);
  }

  async call(client: string, instance: Instance, op: string, method: string, path: string, body?: unknown, extra: Partial<Exchange> = {}) {
    const entry: Exchange = { client, instance: instance.name, op, path, body, sentAt: Date.now(), doneAt: 0, status: 0, ...extra };
    this.log.push(entry);
    try {
      const res = await fetch(`${instance.url}${path}`, {
        method,
        headers: {
          ...(body === undefined ? {} : { 'content-type': 'application/json' }),
          ...(entry.idempotencyKey === undefined ? {} : { 'idempotency-key': entry.idempotencyKey }),
        },
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: AbortSignal.timeout(this.timeoutMs),
      });
      entry.status = res.status;
      const text = await res.text();
      entry.answer = text ? JSON.parse(text) : undefined;
    } catch (err) {
      entry.status = (err as Error).name === 'TimeoutError' ? -1 : 0;
      entry.answer = String((err as Error).message);
    }
    entry.doneAt = Date.now();
    return entry;
  }
}

/**
 * A buyer: reserve 3 (waiting for them at times, half of the time with an Idempotency-Key), then confirm 1 in time,
 * late, twice, on another instance, or walk away. Sends a keyed reserve it confirmed again at times, as a payment
 * system retrying an order would (the checker: it must answer with the confirmed reservation). Releases what it
 * bought later.
 */
export async function buyer(t: Traffic, id: string, pool: string): Promise<void> {
  const owner = `buyer-${id}`;
  const bought: string[] = [];
  for (let order = 0; !t.stopped; order++) {
    await sleep(between(200, 1500));
    if (t.stopped) break;
    const at = t.live();
    const ttlMs = Math.round(between(2000, 4000));
    // A third of the reserves wait for items when too few are free (waitMs), and take their turn in the line.
    const wait = Math.random() < 0.3 ? { waitMs: Math.round(between(200, 2000)) } : {};
    const body = { owner, count: 3, ttlMs, ...wait };
    const keyed = Math.random() < 0.5 ? { idempotencyKey: `${owner}-order-${order}` } : {};
    const r = await t.call(owner, at, 'reserve', 'POST', `/v1/pools/${pool}/reservations`, body, keyed);
    if (r.status !== 201) continue;
    const reservation = r.answer;
    const expiresAt = Date.parse(reservation.expiresAt);
    const choice = reservation.items[Math.floor(Math.random() * 3)].resourceId;
    const roll = Math.random();
    const confirm = (instance: Instance) =>
      t.call(
        owner,
        instance,
        'confirm',
        'POST',
        `/v1/reservations/${reservation.id}/confirm`,
        { resourceIds: [choice] },
        {
          expiresAt,
          reservationCreatedAt: r.sentAt,
        },
      );
    let done;
    if (roll < 0.55) {
      await sleep(between(0, ttlMs * 0.6));
      done = await confirm(t.live());
    } else if (roll < 0.65) {
      await sleep(ttlMs + between(500, 2500)); // late: after expiry
      done = await confirm(t.live());
    } else if (roll < 0.75) {
      await sleep(between(0, ttlMs * 0.5));
      const first = t.live();
      const both = await Promise.all([confirm(first), confirm(t.live(first))]); // twice, on two instances
      done = both.find((x) => x.status === 200) ?? both[0];
    } else if (roll < 0.85) {
      await t.call(owner, t.live(), 'release', 'DELETE', `/v1/reservations/${reservation.id}`);
    } // else: walks away; the hold expires
    if (done?.status === 200) bought.push(choice);
    if (done?.status === 200 && keyed.idempotencyKey && Math.random() < 0.5) {
      await sleep(between(0, 6000));
      await t.call(owner, t.live(), 'reserve-retry', 'POST', `/v1/pools/${pool}/reservations`, body, {
        ...keyed,
        reservationCreatedAt: r.sentAt,
      });
    }
    // Each buyer keeps at most one number, so the pool keeps flowing.
    if (bought.length > 1 || (bought.length > 0 && Math.random() < 0.3)) {
      const item = bought.shift()!;
      await t.call(owner, t.live(), 'release-resource', 'POST', `/v1/pools/${pool}/resources/${item}/release`, { owner });
    }
  }
}

/** A reviewer: pull a task, heartbeat, then complete, abandon or vanish. Gives completed tasks back later (re-review). */
export async function reviewer(t: Traffic, id: string, pool: string): Promise<void> {
  const name = `reviewer-${id}`;
  const done: string[] = [];
  while (!t.stopped) {
    await sleep(between(200, 1500));
    if (t.stopped) break;
    const lease = await t.call(name, t.live(), 'pull', 'POST', `/v1/pools/${pool}/tasks/next`, { reviewer: name, leaseMs: 3000 });
    if (lease.status !== 200) continue;
    const { leaseId, resourceId } = lease.answer;
    let expiresAt = Date.parse(lease.answer.expiresAt);
    let expiryKnown = true;
    await sleep(between(100, 1500));
    if (Math.random() < 0.5) {
      const beat = await t.call(name, t.live(), 'heartbeat', 'POST', `/v1/tasks/${leaseId}/heartbeat`, { leaseMs: 3000 });
      if (beat.status === 200) expiresAt = Date.parse(beat.answer.expiresAt);
      else if (beat.status === 503 || beat.status <= 0) expiryKnown = false;
      await sleep(between(100, 1000));
    }
    const roll = Math.random();
    if (roll < 0.5) {
      const c = await t.call(name, t.live(), 'complete', 'POST', `/v1/tasks/${leaseId}/complete`, undefined, {
        expiresAt,
        expiryKnown,
        reservationCreatedAt: lease.sentAt,
      });
      if (c.status === 200) done.push(resourceId);
    } else if (roll < 0.8) {
      await t.call(name, t.live(), 'abandon', 'POST', `/v1/tasks/${leaseId}/abandon`);
    } // else: vanishes; the lease expires
    if (done.length > 1 || (done.length > 0 && Math.random() < 0.3)) {
      await t.call(name, t.live(), 'release-resource', 'POST', `/v1/pools/${pool}/resources/${done.shift()}/release`, { owner: name });
    }
  }
}
