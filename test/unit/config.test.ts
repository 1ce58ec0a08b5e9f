import { readFileSync } from 'node:fs';
import { describe, expect, it } from 'vitest';
import { parseApiKeys } from '../../src/common/auth.js';
import { AppConfig, ConfigError, expiryBudgetWarning, loadConfig, trustProxyOption } from '../../src/config/app-config.js';

describe('loadConfig', () => {
  it('applies the documented defaults', () => {
    const config = loadConfig({});
    expect(config.DATABASE_URL).toBe('postgres://postgres@127.0.0.1:5432/respool');
    expect(config.REDIS_URL).toBe('redis://127.0.0.1:6379');
    expect(config.PORT).toBe(3000);
    expect(config.SWEEP_INTERVAL_MS).toBe(250);
  });

  it('parses numbers and ignores unrelated variables', () => {
    const config = loadConfig({ PORT: '8080', SWEEP_INTERVAL_MS: '100', HOME: '/root' });
    expect(config.PORT).toBe(8080);
    expect(config.SWEEP_INTERVAL_MS).toBe(100);
    expect(config).not.toHaveProperty('HOME');
  });

  it('reports every bad variable at once', () => {
    let error: unknown;
    try {
      loadConfig({ PORT: 'eighty', DATABASE_URL: 'mysql://x', REDIS_URL: 'http://x', LOG_LEVEL: 'loud' });
    } catch (err) {
      error = err;
    }
    expect(error).toBeInstanceOf(ConfigError);
    const problems = (error as ConfigError).problems.map((p) => p.split('=')[0]).sort();
    expect(problems).toEqual(['DATABASE_URL', 'LOG_LEVEL', 'PORT', 'REDIS_URL']);
    expect((error as ConfigError).message).toContain('PORT="eighty"');
  });

  it('tells a value that is no integer only that, and one out of bounds its bound', () => {
    const problemsOf = (env: Record<string, string>) => {
      try {
        loadConfig(env);
      } catch (err) {
        return (err as ConfigError).problems;
      }
      throw new Error('accepted');
    };
    expect(problemsOf({ PORT: 'abc' })).toEqual(['PORT="abc": PORT must be an integer number']);
    expect(problemsOf({ PORT: '1.5' })).toEqual(['PORT="1.5": PORT must be an integer number']);
    expect(problemsOf({ PORT: '70000' })).toEqual(['PORT="70000": PORT must not be greater than 65535']);
    expect(problemsOf({ SHUTDOWN_TIMEOUT_MS: '0' })).toEqual(['SHUTDOWN_TIMEOUT_MS="0": SHUTDOWN_TIMEOUT_MS must not be less than 1000']);
  });

  it('warns when the hold grace and the sweep interval leave too little of the 2 s expiry promise for a sweep pass', () => {
    const base = { DATABASE_URL: 'postgres://x' };
    expect(expiryBudgetWarning(loadConfig(base))).toBeNull(); // 500 + 250
    expect(expiryBudgetWarning(loadConfig({ ...base, HOLD_GRACE_MS: '1000', SWEEP_INTERVAL_MS: '500' }))).toBeNull();
    expect(expiryBudgetWarning(loadConfig({ ...base, HOLD_GRACE_MS: '1000', SWEEP_INTERVAL_MS: '1500' }))).toMatch(
      /^HOLD_GRACE_MS \(1000\) \+ SWEEP_INTERVAL_MS \(1500\) = 2500 ms: expired items may take longer than the 2 s/,
    );
  });

  it('refuses an idempotency TTL longer than the reservations are kept', () => {
    expect(() => loadConfig({ IDEMPOTENCY_TTL_MS: '7200000', RESERVATION_RETENTION_MS: '3600000' })).toThrow(
      /IDEMPOTENCY_TTL_MS="7200000": must not exceed RESERVATION_RETENTION_MS \(3600000\)/,
    );
    expect(loadConfig({ IDEMPOTENCY_TTL_MS: '3600000', RESERVATION_RETENTION_MS: '3600000' }).IDEMPOTENCY_TTL_MS).toBe(3_600_000);
  });

  it('takes TRUST_PROXY as true or a list of addresses, CIDR ranges and range names, and refuses anything else (Fastify would, at start-up, with a stack)', () => {
    for (const value of ['true', 'false', '10.0.0.1', '10.0.0.0/8, 192.168.1.1', 'loopback,::1', 'fd00::/8', '10.0.0.0/1']) {
      expect(loadConfig({ TRUST_PROXY: value }).TRUST_PROXY, value).toBe(value);
    }
    // A number of hops lets a client that reaches the instance directly name any address; /0 proxy-addr refuses.
    for (const value of ['yes', '10.0.0.0/33', '999.1.1.1', '10.0.0.1/8/1', 'loopback,', '2', '0.0.0.0/0', '::/0', '10.0.0.0/255.0.0.0']) {
      expect(() => loadConfig({ TRUST_PROXY: value }), value).toThrow(/TRUST_PROXY=.*is not an address, a CIDR range/);
    }
    expect([trustProxyOption(''), trustProxyOption('true'), trustProxyOption('loopback')]).toEqual([false, true, 'loopback']);
  });

  it('refuses a URL that cannot be parsed with the other bad variables, and never shows a password', () => {
    let error: unknown;
    try {
      loadConfig({
        DATABASE_URL: 'postgres://app:S3cretPW@db:99999/x',
        REDIS_URL: 'redis:/:RedisPW@h',
        PORT: 'eighty',
      });
    } catch (err) {
      error = err;
    }
    expect(error).toBeInstanceOf(ConfigError);
    const { problems, message } = error as ConfigError;
    expect(problems.map((p) => p.split('=')[0]).sort()).toEqual(['DATABASE_URL', 'PORT', 'REDIS_URL']);
    expect(message).toContain('DATABASE_URL="postgres://app:***@db:99999/x"');
    expect(message).toContain('REDIS_URL="redis:/:***@h"');
    expect(message).not.toMatch(/S3cretPW|RedisPW/);
    expect(loadConfig({ DATABASE_URL: 'postgres://app:pw@db:5432/x' }).DATABASE_URL).toBe('postgres://app:pw@db:5432/x');
  });
});

describe('API_KEYS', () => {
  const admin = 'admin-key-0123456789';
  it('takes role:key entries and keeps the keys by digest only', () => {
    const { keys, problems } = parseApiKeys(` admin:${admin}, client:client-key-0123456789,reviewer:rev/key+0123456789= `);
    expect(problems).toEqual([]);
    expect([...keys.values()].map((caller) => caller.role).sort()).toEqual(['admin', 'client', 'reviewer']);
    expect([...keys.keys()].join()).not.toContain(admin);
    expect(loadConfig({ API_KEYS: `admin:${admin}` }).API_KEYS).toBe(`admin:${admin}`);
    expect(loadConfig({}).API_KEYS).toBe('');
  });

  it('binds a client or reviewer key to one owner (it may hold ":"), never an admin key', () => {
    const { keys, problems } = parseApiKeys(`client:${admin}:user:1,reviewer:rev-key-0123456789ab:r-7,admin:adm-key-0123456789ab:x`);
    expect(problems).toEqual(['entry 3: an admin key acts for every owner; it takes none']);
    expect([...keys.values()]).toEqual([
      { role: 'client', owner: 'user:1' },
      { role: 'reviewer', owner: 'r-7' },
    ]);
    for (const owner of ['o'.repeat(129), ' user-1']) {
      expect(parseApiKeys(`client:${admin}:${owner}`).problems).toEqual([
        'entry 1: the owner a key acts for must be 1-128 characters, with no space at either end',
      ]);
    }
    expect(parseApiKeys(`client:${admin}:${'😀'.repeat(128)}`).problems).toEqual([]);
    // An entry is trimmed as a whole: a space before the next comma is no part of the owner.
    expect([...parseApiKeys(`client:${admin}:user-1 , reviewer:rev-key-0123456789ab`).keys.values()][0]).toEqual({
      role: 'client',
      owner: 'user-1',
    });
  });

  it('refuses an unknown role, a short or badly formed key, and one key given two roles, never showing a key', () => {
    const { problems } = parseApiKeys(`root:${admin},client:short,client:${admin} x,admin:${admin},reviewer:${admin},client`);
    expect(problems).toEqual([
      'entry 1 must start with a role (admin, client, reviewer) and ":"',
      'entry 2: a key must be 16-256 letters, digits or . _ ~ + / = -',
      'entry 3: a key must be 16-256 letters, digits or . _ ~ + / = -',
      'entry 5: its key is given another role or owner already (admin)',
      'entry 6 must start with a role (admin, client, reviewer) and ":"',
    ]);
    let error: unknown;
    try {
      loadConfig({ API_KEYS: `admin:${admin},client:short` });
    } catch (err) {
      error = err;
    }
    expect(error).toBeInstanceOf(ConfigError);
    expect((error as ConfigError).message).toContain('API_KEYS="***": entry 2: a key must be');
    expect((error as ConfigError).message).not.toContain(admin);
  });
});

describe('the README configuration table', () => {
  /** `| \`NAME\` | \`default\` | meaning |` rows of the README's table. */
  function documented(): Map<string, string> {
    const readme = readFileSync(new URL('../../README.md', import.meta.url), 'utf8');
    const rows = new Map<string, string>();
    for (const m of readme.matchAll(/^\| `([A-Z][A-Z0-9_]*)` \| `([^`]*)` \|/gm)) rows.set(m[1], m[2]);
    return rows;
  }

  it('lists every setting the service reads, and nothing else, with its default as the code has it', () => {
    const defaults = new AppConfig();
    const rows = documented();
    expect([...rows.keys()].sort()).toEqual(Object.keys(defaults).sort());
    for (const [name, value] of rows) expect(`${name}=${value}`).toBe(`${name}=${String(defaults[name as keyof AppConfig])}`);
  });
});
