import { ValidationError } from 'class-validator';
import { describe, expect, it, vi } from 'vitest';
import { RateLimiter } from '../../src/common/rate-limiter.js';
import { bodyHash, stableStringify } from '../../src/common/stable-json.js';
import { flattenValidationErrors } from '../../src/common/validation.js';
import { compareIds } from '../../src/redis/hold-store.repository.js';
import {
  checkpointKey,
  freeMember,
  makeReservationId,
  markerKey,
  poolBase,
  poolKeys,
  poolKeysOf,
  poolOfReservationId,
} from '../../src/redis/keys.js';
import { apiState } from '../../src/reservations/reservation.view.js';

describe('Redis keys', () => {
  it('puts every key of a pool in the pool hash tag, under the prefix', () => {
    const keys = poolKeys('rp:', 'phone-bj');
    expect(poolBase('rp:', 'phone-bj')).toBe('rp:{phone-bj}:');
    for (const key of [
      keys.free,
      keys.itemBucket('5780'),
      keys.expiries,
      keys.hold('5780'),
      keys.reservation('x'),
      keys.attribute('city', 'bj'),
    ]) {
      expect(key.startsWith('rp:{phone-bj}:')).toBe(true);
    }
    expect(markerKey('rp:')).toBe('rp:meta:rebuilt:3');
    expect(freeMember('138', '7')).toBe('138\u00007');
  });

  it("keeps the checkpoint under the prefix, in the marker's Redis Cluster slot (its hash tag is the marker's name)", () => {
    expect(checkpointKey('rp:')).toBe('rp:meta:checkpoint{rp:meta:rebuilt:3}');
  });

  it("finds the keys of the pools named only: not another pool's, another deployment's or another application's", () => {
    const own = poolKeysOf('rp:', ['phone-bj']);
    expect(own.glob).toBe('rp:{*');
    expect(own.poolOf(poolKeys('rp:', 'phone-bj').hold('5780'))).toBe('phone-bj');
    expect(own.poolOf(poolKeys('rp:', 'phone-sh').free)).toBeNull();
    expect(own.poolOf(poolKeys('rp:staging:', 'phone-bj').free)).toBeNull();
    expect(own.poolOf('rp:meta:rebuilt:3')).toBeNull();
    const bare = poolKeysOf('', ['phone-bj']);
    expect(bare.poolOf('{phone-bj}:free')).toBe('phone-bj');
    expect(bare.poolOf('{user42}:session')).toBeNull();
  });

  it('round-trips the pool through a reservation id and rejects anything else', () => {
    const id = makeReservationId('phone-bj', '9b2d7c1e-1f7a-4c55-9a43-2b0f6f1d2e11');
    expect(poolOfReservationId(id)).toBe('phone-bj');
    expect(poolOfReservationId('phone-bj.not-a-uuid')).toBeNull();
    expect(poolOfReservationId('Phone.9b2d7c1e-1f7a-4c55-9a43-2b0f6f1d2e11')).toBeNull();
    expect(poolOfReservationId('9b2d7c1e-1f7a-4c55-9a43-2b0f6f1d2e11')).toBeNull();
  });

  it('orders resource ids numerically', () => {
    expect(['10', '9', '100', '11'].sort(compareIds)).toEqual(['9', '10', '11', '100']);
  });
});

describe('idempotency body hash', () => {
  it('ignores key order and undefined fields, and tells different bodies apart', () => {
    expect(stableStringify({ b: 1, a: { d: [1, { z: 1, y: 2 }], c: undefined } })).toBe('{"a":{"d":[1,{"y":2,"z":1}]},"b":1}');
    expect(bodyHash({ owner: 'u', count: 3 })).toBe(bodyHash({ count: 3, owner: 'u' }));
    expect(bodyHash({ owner: 'u', count: 3 })).not.toBe(bodyHash({ owner: 'u', count: 2 }));
  });
});

describe('validation errors', () => {
  it('flattens nested errors into field paths with reasons', () => {
    const child = Object.assign(new ValidationError(), {
      property: 'attributes',
      constraints: { flat: 'attributes must be flat' },
      children: [],
    });
    const parent = Object.assign(new ValidationError(), { property: 'filter', children: [child] });
    const count = Object.assign(new ValidationError(), {
      property: 'count',
      constraints: { max: 'too big', int: 'not an integer' },
      children: [],
    });
    expect(flattenValidationErrors([parent, count])).toEqual([
      { field: 'filter.attributes', reason: 'attributes must be flat' },
      { field: 'count', reason: 'too big; not an integer' },
    ]);
  });
});

describe('reservation state on the Redis clock', () => {
  it('reads a held reservation past its expiry as expired, and a commit in flight as held', () => {
    expect(apiState({ state: 'held', expiresMs: 1000, nowMs: 999 })).toBe('held');
    expect(apiState({ state: 'held', expiresMs: 1000, nowMs: 1000 })).toBe('expired');
    expect(apiState({ state: 'confirming', expiresMs: 1000, nowMs: 5000 })).toBe('held');
    expect(apiState({ state: 'released', expiresMs: 1000, nowMs: 0 })).toBe('released');
  });
});

describe('RateLimiter', () => {
  it('allows a burst, then the rate, per client', () => {
    let now = 0;
    const limiter = new RateLimiter(2, 3, () => now);
    expect([1, 2, 3, 4].map(() => limiter.take('a'))).toEqual([true, true, true, false]);
    expect(limiter.take('b')).toBe(true);
    now = 500;
    expect(limiter.take('a')).toBe(true);
    expect(limiter.take('a')).toBe(false);
  });

  it('by default counts time on a clock the wall clock does not move: a step back of 30 s refused every client with a bucket for 30 s', () => {
    const wall = Date.now.bind(Date);
    let step = 0;
    const stepped = vi.spyOn(Date, 'now').mockImplementation(() => wall() + step);
    try {
      const limiter = new RateLimiter(20, 40);
      expect(limiter.take('a')).toBe(true);
      step = -30_000;
      expect(limiter.take('a')).toBe(true);
    } finally {
      stepped.mockRestore();
    }
  });
});
