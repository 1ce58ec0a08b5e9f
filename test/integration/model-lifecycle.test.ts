/**
 * Randomized model-based test of the reservation lifecycle against docs/API.md.
 *
 * A plain reference model of one small number pool is driven alongside the real service (two instances on one
 * database and Redis prefix, each request sent to either at random). After every step the HTTP status, error code,
 * the body fields API.md defines and the pool's stats are compared with the model; at the end of a sequence the
 * t_resource rows are compared too. A mismatch prints the seed and the step history so it can be replayed:
 *   MODEL_SEEDS=17 npx vitest run test/integration/model-lifecycle.test.ts   (one seed, or "1-30", or "3,9,12"; default 1-10)
 *   MODEL_STEPS=45                                                           (steps per sequence; default 40)
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { randomUUID } from 'node:crypto';
import { HttpAnswer, TestInstance, TestWorld, numbers, seedPool, sleep } from '../support/harness.js';
import { Rng } from '../support/random.js';
import { judge, mismatches, parseSeeds } from '../support/model.js';

// ---------- the model ----------
type ItemState = 'free' | 'held' | 'allocated';
interface MItem {
  id: string;
  value: string;
  version: number;
  state: ItemState;
  owner: string | null; // set when allocated
  holder: string | null; // reservation id when held
}
type RState = 'held' | 'confirmed' | 'released' | 'expired';
interface MRes {
  id: string;
  owner: string;
  items: { resourceId: string; value: string; version: number }[];
  state: RState;
  expiresAt: number; // as the service answered it
  confirmBody?: any; // the first 200 confirm answer
  selection?: string[];
}
interface KeyRec {
  body: Record<string, unknown>;
  rid: string;
}

/** JSON with object keys sorted: key order carries no meaning in JSON (Postgres' jsonb reorders them). */
const canon = (v: unknown): string =>
  JSON.stringify(v, (_k, x) =>
    x && typeof x === 'object' && !Array.isArray(x) ? Object.fromEntries(Object.entries(x).sort(([a], [b]) => (a < b ? -1 : 1))) : x,
  );

const OWNERS = ['alice', 'bob'];
const OTHER = 'mallory';

interface SeqConfig {
  n: number;
  maxHoldsPerOwner?: number;
  maxHoldTtlMs: number;
  expiry: boolean;
}

async function runSequence(world: TestWorld, apis: TestInstance[], seed: number, steps: number, coverage: Map<string, number>) {
  const rng = new Rng(seed * 7919 + 17);
  const cfg: SeqConfig = {
    n: rng.int(6, 12),
    maxHoldsPerOwner: rng.chance(0.4) ? rng.int(2, 5) : undefined,
    maxHoldTtlMs: rng.pick([1_200_000, 3_600_000]),
    expiry: rng.chance(0.6),
  };
  const pool = `hm-${seed}-${randomUUID().slice(0, 6)}`;
  const history: string[] = [];
  const log = (s: string) => history.push(s);
  log(`pool ${pool} config ${JSON.stringify(cfg)}`);

  await seedPool(apis[0], pool, numbers(cfg.n, `139${String(seed).padStart(4, '0')}`), {
    maxHoldTtlMs: cfg.maxHoldTtlMs,
    ...(cfg.maxHoldsPerOwner !== undefined && { maxHoldsPerOwner: cfg.maxHoldsPerOwner }),
  });
  const rows = await world.query<{ id: string; value: string }>(
    `SELECT r.id::text AS id, r.value FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = $1 ORDER BY r.id`,
    [pool],
  );
  const items = new Map<string, MItem>(
    rows.map((r) => [r.id, { id: r.id, value: r.value, version: 0, state: 'free', owner: null, holder: null }]),
  );
  const reservations = new Map<string, MRes>();
  const keys = new Map<string, KeyRec>();
  /** Keys whose first reserve failed (nothing held): a retry with the same body is a new attempt. */
  const failedKeys = new Map<string, Record<string, unknown>>();
  let keyCounter = 0;

  const { fail, api, short, errCode, expectStatus } = judge({ seed, steps, replay: ['MODEL_SEEDS', 'MODEL_STEPS'], history, rng, apis });

  const heldBy = (owner: string) =>
    [...reservations.values()].filter((r) => r.owner === owner && r.state === 'held').reduce((s, r) => s + r.items.length, 0);
  const freeCount = () => [...items.values()].filter((i) => i.state === 'free').length;

  const sameSet = (a: string[], b: string[]) => a.length === b.length && [...a].sort().join(',') === [...b].sort().join(',');

  /** Checks a reservation body against the model. */
  const checkResBody = (step: number, body: any, m: MRes, ctx: string) => {
    if (body.id !== m.id) fail(step, `${ctx}: id ${body.id} != ${m.id}`);
    if (body.pool !== pool) fail(step, `${ctx}: pool ${body.pool}`);
    if (body.owner !== m.owner) fail(step, `${ctx}: owner ${body.owner} != ${m.owner}`);
    if (body.state !== m.state) fail(step, `${ctx}: state ${body.state}, model says ${m.state}`);
    const got = (body.items ?? []).map((i: any) => `${i.resourceId}:${i.value}:${i.version}`);
    const want = m.items.map((i) => `${i.resourceId}:${i.value}:${i.version}`);
    if (!sameSet(got, want)) fail(step, `${ctx}: items ${JSON.stringify(got)} != ${JSON.stringify(want)}`);
    if (typeof body.expiresAt !== 'string' || Number.isNaN(Date.parse(body.expiresAt))) fail(step, `${ctx}: expiresAt ${body.expiresAt}`);
    if (m.state === 'confirmed') {
      const cb = m.confirmBody;
      if (!body.allocated || !body.released)
        fail(step, `${ctx}: confirmed reservation without allocated/released: ${JSON.stringify(body)}`);
      const ga = body.allocated.map((a: any) => `${a.resourceId}:${a.value}:${a.version}`);
      const wa = cb.allocated.map((a: any) => `${a.resourceId}:${a.value}:${a.version}`);
      if (!sameSet(ga, wa)) fail(step, `${ctx}: allocated ${JSON.stringify(ga)} != ${JSON.stringify(wa)}`);
      if (!sameSet(body.released, cb.released))
        fail(step, `${ctx}: released ${JSON.stringify(body.released)} != ${JSON.stringify(cb.released)}`);
    }
  };

  const checkStats = async (step: number) => {
    const { i, a } = api();
    const r = await a.get(`/v1/pools/${pool}`);
    const s = r.body?.stats;
    const want = {
      total: cfg.n,
      free: freeCount(),
      held: [...items.values()].filter((x) => x.state === 'held').length,
      allocated: [...items.values()].filter((x) => x.state === 'allocated').length,
    };
    if (r.status !== 200 || JSON.stringify(s) !== JSON.stringify(want)) {
      log(`  stats@${i} -> ${short(r)}`);
      fail(step, `stats ${JSON.stringify(s)} != model ${JSON.stringify(want)}`);
    }
  };

  /** After a wait past every short hold's expiresAt + 2 s: those reservations are expired, their items free. */
  const applyExpiry = () => {
    const now = Date.now();
    for (const r of reservations.values()) {
      if (r.state === 'held' && r.expiresAt + 2000 < now) {
        r.state = 'expired';
        for (const it of r.items) {
          const m = items.get(it.resourceId)!;
          if (m.holder === r.id) {
            m.state = 'free';
            m.holder = null;
          }
        }
      }
    }
  };

  const waitPast = async (expiresAt: number) => {
    const ms = expiresAt + 2300 - Date.now();
    if (ms > 0) await sleep(ms);
    applyExpiry();
  };

  // ---------- operations ----------
  const reserve = async (step: number, body: Record<string, unknown>, key: string | undefined, note: string) => {
    const { i, a } = api();
    const sentAt = Date.now();
    const r = await a.post(`/v1/pools/${pool}/reservations`, body, key ? { 'Idempotency-Key': key } : undefined);
    const answeredAt = Date.now();
    log(`reserve@${i} ${note} ${JSON.stringify(body)}${key ? ` key=${key}` : ''} -> ${short(r)}`);
    const count = (body.count as number) ?? 1;
    const prev = key ? keys.get(key) : undefined;
    if (prev) {
      if (JSON.stringify(prev.body) !== JSON.stringify(body)) {
        expectStatus(step, r, [[409, 'IDEMPOTENCY_KEY_REUSED']]);
        return;
      }
      expectStatus(step, r, [[200]]);
      checkResBody(step, r.body, reservations.get(prev.rid)!, 'replay');
      return;
    }
    const quota = cfg.maxHoldsPerOwner !== undefined && heldBy(body.owner as string) + count > cfg.maxHoldsPerOwner;
    const exhausted = freeCount() < count;
    if (key && (quota || exhausted)) failedKeys.set(key, body);
    if (key && !quota && !exhausted) failedKeys.delete(key);
    if (quota && exhausted)
      return expectStatus(step, r, [
        [429, 'OWNER_QUOTA_EXCEEDED'],
        [409, 'POOL_EXHAUSTED'],
      ]);
    if (quota) return expectStatus(step, r, [[429, 'OWNER_QUOTA_EXCEEDED']]);
    if (exhausted) return expectStatus(step, r, [[409, 'POOL_EXHAUSTED']]);
    expectStatus(step, r, [[201]]);
    const b = r.body;
    if (b.state !== 'held' || b.owner !== body.owner || b.pool !== pool) fail(step, `reserve body ${JSON.stringify(b)}`);
    if (!Array.isArray(b.items) || b.items.length !== count) fail(step, `reserve gave ${b.items?.length} items, asked ${count}`);
    const ids = b.items.map((x: any) => x.resourceId);
    if (new Set(ids).size !== ids.length) fail(step, `reserve gave duplicate items ${ids}`);
    for (const x of b.items) {
      const m = items.get(x.resourceId);
      if (!m) fail(step, `reserve gave unknown item ${x.resourceId}`);
      if (m!.state !== 'free') fail(step, `reserve gave item ${x.resourceId} which the model has ${m!.state} (${m!.holder ?? m!.owner})`);
      if (x.value !== m!.value || x.version !== m!.version)
        fail(step, `reserve item ${x.resourceId}: value/version ${x.value}/${x.version}, model ${m!.value}/${m!.version}`);
    }
    const ttl = (body.ttlMs as number) ?? 600_000;
    const exp = Date.parse(b.expiresAt);
    if (exp < sentAt + ttl - 150 || exp > answeredAt + ttl + 150) fail(step, `expiresAt ${b.expiresAt} not now+${ttl}`);
    for (const x of b.items) {
      const m = items.get(x.resourceId)!;
      m.state = 'held';
      m.holder = b.id;
    }
    reservations.set(b.id, {
      id: b.id,
      owner: body.owner as string,
      items: b.items.map((x: any) => ({ resourceId: x.resourceId, value: x.value, version: x.version })),
      state: 'held',
      expiresAt: exp,
    });
    if (key) keys.set(key, { body, rid: b.id });
  };

  const getRes = async (step: number, m: MRes) => {
    const { i, a } = api();
    const r = await a.get(`/v1/reservations/${m.id}`);
    log(`get@${i} ${m.id.slice(-6)} (model ${m.state}) -> ${short(r)}`);
    expectStatus(step, r, [[200]]);
    checkResBody(step, r.body, m, 'GET');
  };

  const extend = async (step: number, m: MRes, ttlMs: number) => {
    const { i, a } = api();
    const sentAt = Date.now();
    const r = await a.post(`/v1/reservations/${m.id}/extend`, { ttlMs });
    const answeredAt = Date.now();
    log(`extend@${i} ${m.id.slice(-6)} (model ${m.state}) ttl=${ttlMs} -> ${short(r)}`);
    if (m.state === 'expired') return expectStatus(step, r, [[409, 'HOLD_EXPIRED']]);
    if (m.state === 'released' || m.state === 'confirmed') return expectStatus(step, r, [[409, 'RESERVATION_CLOSED']]);
    expectStatus(step, r, [[200]]);
    const eff = Math.min(ttlMs, cfg.maxHoldTtlMs);
    const exp = Date.parse(r.body.expiresAt);
    if (exp < sentAt + eff - 150 || exp > answeredAt + eff + 150) fail(step, `extend expiresAt ${r.body.expiresAt} not now+${eff}`);
    m.expiresAt = exp;
    checkResBody(step, r.body, m, 'extend');
  };

  const judgeConfirm = (step: number, m: MRes, selection: string[], r: HttpAnswer) => {
    const held = new Set(m.items.map((x) => x.resourceId));
    const notIn = selection.some((s) => !held.has(s));
    const notInAllowed: [number, string][] = notIn ? [[422, 'NOT_IN_RESERVATION']] : [];
    if (m.state === 'released') return expectStatus(step, r, [[409, 'RESERVATION_CLOSED'], ...notInAllowed]);
    if (m.state === 'confirmed') {
      if (sameSet(selection, m.selection!)) {
        expectStatus(step, r, [[200]]);
        if (canon(r.body) !== canon(m.confirmBody))
          fail(step, `repeat confirm body differs from the first: ${JSON.stringify(m.confirmBody)}`);
        return;
      }
      return expectStatus(step, r, [[409, 'RESERVATION_CLOSED'], ...notInAllowed]);
    }
    if (notIn) return expectStatus(step, r, [[422, 'NOT_IN_RESERVATION']]);
    if (m.state === 'expired') {
      // After expiry: succeeds for each named item nobody else has taken meanwhile, else HOLD_LOST/HOLD_EXPIRED.
      const lost = selection.some((s) => {
        const it = items.get(s)!;
        const heldItem = m.items.find((x) => x.resourceId === s)!;
        return it.state !== 'free' || it.version !== heldItem.version;
      });
      if (lost)
        return expectStatus(step, r, [
          [409, 'HOLD_LOST'],
          [409, 'HOLD_EXPIRED'],
        ]);
    }
    expectStatus(step, r, [[200]]);
    const b = r.body;
    if (b.id !== m.id || b.state !== 'confirmed') fail(step, `confirm body ${JSON.stringify(b)}`);
    const chosen = new Set(selection);
    const wantAlloc = m.items.filter((x) => chosen.has(x.resourceId)).map((x) => `${x.resourceId}:${x.value}:${x.version + 1}`);
    const gotAlloc = (b.allocated ?? []).map((x: any) => `${x.resourceId}:${x.value}:${x.version}`);
    if (!sameSet(gotAlloc, wantAlloc)) fail(step, `allocated ${JSON.stringify(gotAlloc)} != ${JSON.stringify(wantAlloc)}`);
    const wantRel = m.items.filter((x) => !chosen.has(x.resourceId)).map((x) => x.resourceId);
    if (!sameSet(b.released ?? [], wantRel)) fail(step, `released ${JSON.stringify(b.released)} != ${JSON.stringify(wantRel)}`);
    for (const x of m.items) {
      const it = items.get(x.resourceId)!;
      if (chosen.has(x.resourceId)) {
        it.state = 'allocated';
        it.owner = m.owner;
        it.holder = null;
        it.version = x.version + 1;
      } else if (it.holder === m.id) {
        it.state = 'free';
        it.holder = null;
      }
    }
    m.state = 'confirmed';
    m.selection = [...selection];
    m.confirmBody = b;
  };

  const confirm = async (step: number, m: MRes, selection: string[], note: string) => {
    const { i, a } = api();
    const r = await a.post(`/v1/reservations/${m.id}/confirm`, { resourceIds: selection });
    log(`confirm@${i} ${note} ${m.id.slice(-6)} (model ${m.state}) [${selection}] -> ${short(r)}`);
    judgeConfirm(step, m, selection, r);
  };

  /** The model's side of a release of `m`: its held items free again, the reservation released. */
  const released = (m: MRes) => {
    for (const x of m.items) {
      const it = items.get(x.resourceId)!;
      if (it.holder === m.id) {
        it.state = 'free';
        it.holder = null;
      }
    }
    m.state = 'released';
  };

  const del = async (step: number, m: MRes) => {
    const { i, a } = api();
    const r = await a.del(`/v1/reservations/${m.id}`);
    log(`delete@${i} ${m.id.slice(-6)} (model ${m.state}) -> ${short(r)}`);
    if (m.state === 'confirmed') return expectStatus(step, r, [[409, 'RESERVATION_CLOSED']]);
    expectStatus(step, r, [[200]]);
    released(m);
    checkResBody(step, r.body, m, 'DELETE');
  };

  const releaseResource = async (step: number, it: MItem, owner: string, note: string) => {
    const { i, a } = api();
    const r = await a.post(`/v1/pools/${pool}/resources/${it.id}/release`, { owner });
    log(`release@${i} ${note} item ${it.id} by ${owner} (model ${it.state}/${it.owner}/v${it.version}) -> ${short(r)}`);
    if (it.state !== 'allocated' || it.owner !== owner) return expectStatus(step, r, [[409, 'NOT_ALLOCATED']]);
    expectStatus(step, r, [[200]]);
    it.state = 'free';
    it.owner = null;
    it.version += 1;
    const b = r.body;
    if (b.id !== it.id || b.state !== 'free' || b.version !== it.version || b.owner !== null || b.value !== it.value || b.pool !== pool)
      fail(step, `release body ${JSON.stringify(b)}, model v${it.version}`);
  };

  const getResource = async (step: number, it: MItem) => {
    const { i, a } = api();
    const r = await a.get(`/v1/pools/${pool}/resources/${it.id}`);
    log(`getres@${i} ${it.id} (model ${it.state}/${it.owner}/v${it.version}) -> ${short(r)}`);
    expectStatus(step, r, [[200]]);
    const b = r.body;
    if (b.id !== it.id || b.state !== it.state || b.version !== it.version || b.owner !== it.owner || b.value !== it.value)
      fail(step, `resource ${JSON.stringify(b)} != model ${JSON.stringify(it)}`);
  };

  // ---------- the random walk ----------
  const ttlChoices = [undefined, 900_000, 1_200_000];
  const newBody = (): Record<string, unknown> => {
    const body: Record<string, unknown> = { owner: rng.pick(OWNERS), count: rng.int(1, 3) };
    const ttl = rng.pick(ttlChoices);
    if (ttl !== undefined) body.ttlMs = ttl;
    if (rng.chance(0.2)) delete body.count; // default 1
    return body;
  };

  for (let step = 0; step < steps; step++) {
    const all = [...reservations.values()];
    const open = all.filter((r) => r.state === 'held');
    const allocated = [...items.values()].filter((i) => i.state === 'allocated');
    const op = rng.weighted<string>([
      [20, 'reserve'],
      [8, 'reserveKey'],
      [keys.size ? 5 : 0, 'replaySame'],
      [keys.size ? 3 : 0, 'replayDiff'],
      [failedKeys.size ? 3 : 0, 'retryFailedKey'],
      [all.length ? 8 : 0, 'get'],
      [all.length ? 6 : 0, 'extend'],
      [open.length ? 14 : 0, 'confirm'],
      [open.length ? 3 : 0, 'confirmNotIn'],
      [all.length ? 5 : 0, 'confirmAny'],
      [all.length ? 8 : 0, 'delete'],
      [open.length ? 4 + Math.max(0, 6 - freeCount()) : 0, 'deleteOpen'],
      [allocated.length ? 6 : 0, 'releaseOwner'],
      [allocated.length ? 2 : 0, 'releaseOther'],
      [3, 'releaseAny'],
      [5, 'getResource'],
      [1, 'getUnknown'],
      [cfg.expiry ? 3 : 0, 'shortReserve'],
      [cfg.expiry ? 2 : 0, 'shortTimed'],
      [cfg.expiry && all.some((r) => r.state === 'expired') ? 6 : 0, 'confirmExpired'],
      [open.length ? 2 : 0, 'parConfirmSame'],
      [open.some((r) => r.items.length > 1) ? 2 : 0, 'parConfirmDiff'],
      [open.length ? 2 : 0, 'parDeleteConfirm'],
      [2, 'parKeyReserve'],
      [allocated.length ? 2 : 0, 'parRelease'],
      [cfg.expiry && open.length ? 2 : 0, 'shortExtend'],
    ]);
    coverage.set(op, (coverage.get(op) ?? 0) + 1);
    switch (op) {
      case 'reserve':
        await reserve(step, newBody(), undefined, 'new');
        break;
      case 'reserveKey':
        await reserve(step, newBody(), `k-${seed}-${keyCounter++}`, 'newkey');
        break;
      case 'replaySame': {
        const [k, rec] = rng.pick([...keys.entries()]);
        await reserve(step, { ...rec.body }, k, 'replay-same');
        break;
      }
      case 'retryFailedKey': {
        const [k, body] = rng.pick([...failedKeys.entries()]);
        await reserve(step, { ...body }, k, 'retry-failed-key');
        break;
      }
      case 'replayDiff': {
        const [k, rec] = rng.pick([...keys.entries()]);
        const body = { ...rec.body };
        const what = rng.int(0, 2);
        if (what === 0) body.count = ((body.count as number) ?? 1) === 3 ? 2 : ((body.count as number) ?? 1) + 1;
        else if (what === 1) body.owner = body.owner === 'alice' ? 'bob' : 'alice';
        else body.ttlMs = body.ttlMs === 900_000 ? 1_000_000 : 900_000;
        await reserve(step, body, k, 'replay-diff');
        break;
      }
      case 'get':
        await getRes(step, rng.pick(all));
        break;
      case 'extend':
        await extend(step, rng.chance(0.7) && open.length ? rng.pick(open) : rng.pick(all), rng.pick([60_000, 900_000, 5_000_000]));
        break;
      case 'confirm': {
        const m = rng.pick(open);
        const ids = m.items.map((x) => x.resourceId);
        await confirm(step, m, rng.shuffle(ids).slice(0, rng.int(1, ids.length)), 'valid');
        break;
      }
      case 'confirmNotIn': {
        const m = rng.pick(open);
        const mine = new Set(m.items.map((x) => x.resourceId));
        const stranger = rng.pick([...items.keys()].filter((id) => !mine.has(id)));
        const sel = rng.chance(0.5) ? [m.items[0].resourceId, stranger] : [stranger];
        await confirm(step, m, sel, 'notin');
        break;
      }
      case 'confirmAny': {
        // Any reservation (closed ones too): the same selection again, or a different one.
        const m = rng.pick(all);
        const ids = m.items.map((x) => x.resourceId);
        const sel = m.selection && rng.chance(0.5) ? rng.shuffle(m.selection) : rng.shuffle(ids).slice(0, rng.int(1, ids.length));
        await confirm(step, m, sel, 'any');
        break;
      }
      case 'delete':
        await del(step, rng.pick(all));
        break;
      case 'deleteOpen':
        await del(step, rng.pick(open));
        break;
      case 'releaseOwner': {
        const it = rng.pick(allocated);
        await releaseResource(step, it, it.owner!, 'owner');
        break;
      }
      case 'releaseOther': {
        const it = rng.pick(allocated);
        await releaseResource(step, it, rng.pick([...OWNERS.filter((o) => o !== it.owner), OTHER]), 'other');
        break;
      }
      case 'releaseAny':
        await releaseResource(step, rng.pick([...items.values()]), rng.pick(OWNERS), 'any');
        break;
      case 'getResource':
        await getResource(step, rng.pick([...items.values()]));
        break;
      case 'getUnknown': {
        const { i, a } = api();
        const r = await a.get(`/v1/reservations/${pool}.${randomUUID()}`);
        log(`get-unknown@${i} -> ${short(r)}`);
        expectStatus(step, r, [[404, 'RESERVATION_NOT_FOUND']]);
        break;
      }
      case 'shortReserve': {
        const before = reservations.size;
        await reserve(step, { owner: rng.pick(OWNERS), count: rng.int(1, 3), ttlMs: rng.int(1000, 1500) }, undefined, 'short');
        await checkStats(step);
        if (reservations.size > before) {
          const m = [...reservations.values()].at(-1)!;
          if (rng.chance(0.3)) await getRes(step, m);
          log(`wait past ${new Date(m.expiresAt).toISOString()} + 2 s`);
          await waitPast(m.expiresAt);
        }
        break;
      }
      case 'shortTimed': {
        // A short hold, then around its expiresAt: a confirm before it (must succeed), a confirm after it with nobody
        // having taken its items (must succeed too), or a read and an extend after it (expired, HOLD_EXPIRED).
        const before = reservations.size;
        await reserve(step, { owner: rng.pick(OWNERS), count: rng.int(1, 3), ttlMs: 1000 }, undefined, 'short-timed');
        if (reservations.size === before) break;
        const m = [...reservations.values()].at(-1)!;
        const mode = rng.pick(['confirmBefore', 'confirmAfter', 'readAfter'] as const);
        if (mode === 'confirmBefore') {
          const ms = m.expiresAt - 250 - Date.now();
          if (ms > 0) await sleep(ms);
          log(`(sent at expiresAt - ${m.expiresAt - Date.now()} ms)`);
          const ids = m.items.map((x) => x.resourceId);
          await confirm(step, m, rng.shuffle(ids).slice(0, rng.int(1, ids.length)), 'before-expiry');
        } else if (mode === 'confirmAfter') {
          const ms = m.expiresAt + rng.int(50, 2500) - Date.now();
          if (ms > 0) await sleep(ms);
          log(`(sent at expiresAt + ${Date.now() - m.expiresAt} ms)`);
          const ids = m.items.map((x) => x.resourceId);
          const sel = rng.shuffle(ids).slice(0, rng.int(1, ids.length));
          // Nobody else acts in between: the model's judgement of an expired reservation applies as of now.
          m.state = 'expired';
          for (const x of m.items) {
            const it = items.get(x.resourceId)!;
            if (it.holder === m.id) {
              it.state = 'free';
              it.holder = null;
            }
          }
          await confirm(step, m, sel, 'after-expiry');
          await checkStats(step);
          await waitPast(m.expiresAt);
        } else {
          const ms = m.expiresAt + 100 - Date.now();
          if (ms > 0) await sleep(ms);
          const { i, a } = api();
          const r = await a.get(`/v1/reservations/${m.id}`);
          log(`get@${i} at expiresAt + ${Date.now() - m.expiresAt} ms -> ${short(r)}`);
          if (r.status !== 200 || r.body.state !== 'expired')
            fail(step, `a reservation past its expiresAt reads ${r.body?.state}, not expired`);
          const e = await apis[1 - i].post(`/v1/reservations/${m.id}/extend`, { ttlMs: 60_000 });
          log(`extend@${1 - i} at expiresAt + ${Date.now() - m.expiresAt} ms -> ${short(e)}`);
          if (e.status !== 409 || errCode(e) !== 'HOLD_EXPIRED')
            fail(step, `extend past expiresAt: ${short(e)}, API.md: 409 HOLD_EXPIRED once expired`);
          await waitPast(m.expiresAt);
        }
        break;
      }
      case 'confirmExpired': {
        const m = rng.pick(all.filter((r) => r.state === 'expired'));
        const ids = m.items.map((x) => x.resourceId);
        await confirm(step, m, rng.shuffle(ids).slice(0, rng.int(1, ids.length)), 'late');
        break;
      }
      case 'parConfirmSame': {
        const m = rng.pick(open);
        const ids = m.items.map((x) => x.resourceId);
        const sel = rng.shuffle(ids).slice(0, rng.int(1, ids.length));
        const [r0, r1] = await Promise.all(apis.map((a) => a.post(`/v1/reservations/${m.id}/confirm`, { resourceIds: sel })));
        log(`par-confirm-same ${m.id.slice(-6)} [${sel}] -> @0 ${short(r0)} | @1 ${short(r1)}`);
        if (r0.status !== 200 || r1.status !== 200) fail(step, `the same confirm sent twice at once, before expiry: both must be 200`);
        if (canon(r0.body) !== canon(r1.body)) fail(step, `the same confirm twice at once: bodies differ`);
        judgeConfirm(step, m, sel, r0);
        break;
      }
      case 'parConfirmDiff': {
        const m = rng.pick(open.filter((r) => r.items.length > 1));
        const ids = rng.shuffle(m.items.map((x) => x.resourceId));
        const s0 = [ids[0]];
        const s1 = rng.chance(0.5) ? [ids[1]] : [ids[0], ids[1]];
        const [r0, r1] = await Promise.all([
          apis[0].post(`/v1/reservations/${m.id}/confirm`, { resourceIds: s0 }),
          apis[1].post(`/v1/reservations/${m.id}/confirm`, { resourceIds: s1 }),
        ]);
        log(`par-confirm-diff ${m.id.slice(-6)} @0 [${s0}] -> ${short(r0)} | @1 [${s1}] -> ${short(r1)}`);
        const wins = [r0, r1].filter((r) => r.status === 200).length;
        if (wins !== 1) fail(step, `two different confirms at once, before expiry: ${wins} succeeded (expected exactly one)`);
        const [win, winSel, lose] = r0.status === 200 ? [r0, s0, r1] : [r1, s1, r0];
        if (lose.status !== 409 || errCode(lose) !== 'RESERVATION_CLOSED')
          fail(step, `the losing confirm: ${short(lose)}, expected 409 RESERVATION_CLOSED`);
        judgeConfirm(step, m, winSel, win);
        break;
      }
      case 'parDeleteConfirm': {
        const m = rng.pick(open);
        const ids = m.items.map((x) => x.resourceId);
        const sel = rng.shuffle(ids).slice(0, rng.int(1, ids.length));
        const flip = rng.chance(0.5) ? 1 : 0;
        const [c, d] = await Promise.all([
          apis[flip].post(`/v1/reservations/${m.id}/confirm`, { resourceIds: sel }),
          apis[1 - flip].del(`/v1/reservations/${m.id}`),
        ]);
        log(`par-delete-confirm ${m.id.slice(-6)} confirm [${sel}] -> ${short(c)} | delete -> ${short(d)}`);
        if (c.status === 200 && d.status === 409 && errCode(d) === 'RESERVATION_CLOSED') {
          judgeConfirm(step, m, sel, c);
        } else if (d.status === 200 && c.status === 409 && errCode(c) === 'RESERVATION_CLOSED') {
          released(m);
          checkResBody(step, d.body, m, 'DELETE');
        } else fail(step, `confirm and DELETE at once: not one of (200, 409 RESERVATION_CLOSED) / (409 RESERVATION_CLOSED, 200)`);
        break;
      }
      case 'parKeyReserve': {
        const body = newBody();
        const key = `k-${seed}-${keyCounter++}`;
        const [r0, r1] = await Promise.all(apis.map((a) => a.post(`/v1/pools/${pool}/reservations`, body, { 'Idempotency-Key': key })));
        log(`par-key-reserve ${JSON.stringify(body)} key=${key} -> @0 ${short(r0)} | @1 ${short(r1)}`);
        const cnt = (body.count as number) ?? 1;
        const quota = cfg.maxHoldsPerOwner !== undefined && heldBy(body.owner as string) + cnt > cfg.maxHoldsPerOwner;
        if (quota || freeCount() < cnt) {
          for (const r of [r0, r1])
            if (r.status !== 409 && r.status !== 429) fail(step, `keyed reserve that cannot be served: ${short(r)}`);
          break;
        }
        const statuses = [r0.status, r1.status].sort().join(',');
        if (statuses !== '200,201') fail(step, `the same keyed reserve twice at once: ${statuses}, expected one 201 and one 200`);
        if (r0.body.id !== r1.body.id) fail(step, `the same keyed reserve twice at once gave two reservations`);
        const first = r0.status === 201 ? r0 : r1;
        for (const x of first.body.items) {
          const it = items.get(x.resourceId)!;
          if (it.state !== 'free' || it.version !== x.version) fail(step, `keyed reserve gave ${x.resourceId}, model ${it.state}`);
          it.state = 'held';
          it.holder = first.body.id;
        }
        reservations.set(first.body.id, {
          id: first.body.id,
          owner: body.owner as string,
          items: first.body.items.map((x: any) => ({ resourceId: x.resourceId, value: x.value, version: x.version })),
          state: 'held',
          expiresAt: Date.parse(first.body.expiresAt),
        });
        keys.set(key, { body, rid: first.body.id });
        break;
      }
      case 'parRelease': {
        const it = rng.pick(allocated);
        const [r0, r1] = await Promise.all(apis.map((a) => a.post(`/v1/pools/${pool}/resources/${it.id}/release`, { owner: it.owner })));
        log(`par-release ${it.id} by ${it.owner} -> @0 ${short(r0)} | @1 ${short(r1)}`);
        const statuses = [r0.status, r1.status].sort().join(',');
        if (statuses !== '200,409') fail(step, `a release sent twice at once: ${statuses}, expected one 200 and one 409 NOT_ALLOCATED`);
        if (errCode(r0.status === 409 ? r0 : r1) !== 'NOT_ALLOCATED') fail(step, `the losing release is not NOT_ALLOCATED`);
        it.state = 'free';
        it.owner = null;
        it.version += 1;
        break;
      }
      case 'shortExtend': {
        const m = rng.pick(open);
        await extend(step, m, rng.int(1000, 1500));
        await checkStats(step);
        log(`wait past ${new Date(m.expiresAt).toISOString()} + 2 s`);
        await waitPast(m.expiresAt);
        break;
      }
    }
    await checkStats(step);
  }

  // ---------- at the end: every reservation read back, and Postgres ----------
  for (const m of reservations.values()) await getRes(steps, m);
  const db = await world.query<{ id: string; state: number; version: number; owner: string | null }>(
    `SELECT r.id::text AS id, r.state, r.version, r.owner FROM t_resource r JOIN t_pool p ON p.id = r.pool_id WHERE p.name = $1`,
    [pool],
  );
  for (const row of db) {
    const it = items.get(row.id)!;
    const want = { state: it.state === 'allocated' ? 2 : 1, version: it.version, owner: it.state === 'allocated' ? it.owner : null };
    const got = { state: row.state, version: row.version, owner: row.owner };
    if (JSON.stringify(got) !== JSON.stringify(want))
      fail(steps, `t_resource ${row.id}: ${JSON.stringify(got)} != model ${JSON.stringify(want)}`);
  }
}

describe('model-based: the reservation lifecycle against API.md, on two instances', () => {
  const world = new TestWorld('model');
  const apis: TestInstance[] = [];
  beforeAll(async () => {
    apis.push(await world.start());
    apis.push(await world.start());
  });
  afterAll(() => world.cleanup());

  it('random sequences of reserves, replays, extends, confirms, releases and expiries agree with the model', async () => {
    const seeds = parseSeeds(process.env.MODEL_SEEDS ?? '1-10');
    const steps = Number(process.env.MODEL_STEPS ?? 40);
    const coverage = new Map<string, number>();
    const failures = await mismatches(seeds, (seed) => runSequence(world, apis, seed, steps, coverage));
    expect(failures).toEqual([]);
    if (seeds.length * steps >= 400) {
      // The walk reached what it is for: confirms (alone, after expiry, and racing each other or a DELETE),
      // releases and extends.
      for (const op of ['confirm', 'confirmExpired', 'parConfirmSame', 'parConfirmDiff', 'parDeleteConfirm', 'releaseOwner', 'extend']) {
        expect(coverage.get(op) ?? 0, `${op}: ${JSON.stringify(Object.fromEntries(coverage))}`).toBeGreaterThan(0);
      }
    }
  }, 600_000);
});
