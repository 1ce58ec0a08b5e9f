import { describe, expect, it } from 'vitest';
import { ConfigError, loadConfig } from '../../src/config/app-config.js';

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
});
