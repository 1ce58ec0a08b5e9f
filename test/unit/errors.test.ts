import { HttpException, NotFoundException, PayloadTooLargeException, ServiceUnavailableException } from '@nestjs/common';
import { describe, expect, it } from 'vitest';
import { isPostgresOutage, isRedisOutage, unreachable } from '../../src/common/dependency-errors.js';
import { DomainError, ErrorCode, HTTP_STATUS } from '../../src/common/errors.js';
import { mapError } from '../../src/common/http-errors.js';

describe('mapError', () => {
  it('maps every domain error code to its API status with the error body', () => {
    for (const code of Object.values(ErrorCode)) {
      const mapped = mapError(new DomainError(code, `because ${code}`, { x: 1 }));
      expect(mapped.status).toBe(HTTP_STATUS[code]);
      expect(mapped.body).toEqual({ error: { code, message: `because ${code}`, details: { x: 1 } } });
    }
    expect(HTTP_STATUS[ErrorCode.NOT_IN_RESERVATION]).toBe(422);
    expect(HTTP_STATUS[ErrorCode.OWNER_QUOTA_EXCEEDED]).toBe(429);
    expect(HTTP_STATUS[ErrorCode.DEPENDENCY_UNAVAILABLE]).toBe(503);
  });

  it('turns unknown errors into a 500 that leaks nothing', () => {
    const mapped = mapError(new TypeError('secret internals at /srv/app.js:12'));
    expect(mapped).toEqual({
      status: 500,
      body: { error: { code: 'INTERNAL_ERROR', message: 'internal error', details: {} } },
      internal: true,
    });
  });

  it('maps framework errors: unknown route, body too large, malformed JSON, readiness failure', () => {
    expect(mapError(new NotFoundException()).body.error.code).toBe('ROUTE_NOT_FOUND');
    expect(mapError(new PayloadTooLargeException()).status).toBe(413);
    expect(mapError({ code: 'FST_ERR_CTP_BODY_TOO_LARGE', statusCode: 413, message: 'x' }).body.error.code).toBe('PAYLOAD_TOO_LARGE');
    const badJson = mapError(new HttpException('Unexpected token', 400));
    expect(badJson.status).toBe(400);
    expect(badJson.body.error.code).toBe('VALIDATION_FAILED');
    const notReady = mapError(new ServiceUnavailableException({ status: 'error' }));
    expect(notReady.status).toBe(503);
    expect(notReady.body.error.code).toBe('DEPENDENCY_UNAVAILABLE');
  });
});

describe('dependency outages', () => {
  it('tells a lost Postgres from a bad statement', () => {
    expect(isPostgresOutage(Object.assign(new Error('connect ECONNREFUSED'), { code: 'ECONNREFUSED' }))).toBe(true);
    expect(isPostgresOutage(new Error('Connection terminated unexpectedly'))).toBe(true);
    expect(isPostgresOutage({ code: '57P01' })).toBe(true);
    expect(isPostgresOutage({ code: '57014' })).toBe(true);
    expect(isPostgresOutage({ code: '25P03' })).toBe(true);
    expect(isPostgresOutage({ code: '40P01' })).toBe(true); // deadlock: rolled back, a retry may pass
    expect(isPostgresOutage({ driverError: { code: '08006' } })).toBe(true);
    expect(isPostgresOutage({ code: '42601' })).toBe(false);
    expect(isPostgresOutage({ code: '23505' })).toBe(false);
  });

  it('tells a lost Redis from a script error', () => {
    expect(isRedisOutage(new Error("Stream isn't writeable and enableOfflineQueue options is false"))).toBe(true);
    expect(isRedisOutage(Object.assign(new Error('LOADING Redis is loading'), { name: 'ReplyError' }))).toBe(true);
    expect(isRedisOutage(Object.assign(new Error('ERR user_script:1: bad'), { name: 'ReplyError' }))).toBe(false);
  });

  it('says why a dependency cannot be reached, also when a host has two addresses (an AggregateError has no message)', () => {
    const refused = (address: string) => Object.assign(new Error(`connect ECONNREFUSED ${address}:5432`), { code: 'ECONNREFUSED' });
    const both = new AggregateError([refused('::1'), refused('127.0.0.1')]); // message ''
    expect(unreachable('Postgres', new URL('postgres://u:pw@localhost/x'), 5432, both).message).toBe(
      'Postgres at localhost:5432 cannot be reached: connect ECONNREFUSED ::1:5432; connect ECONNREFUSED 127.0.0.1:5432',
    );
    expect(unreachable('Redis', new URL('redis://h:7000'), 6379, Object.assign(new Error(''), { code: 'ETIMEDOUT' })).message).toBe(
      'Redis at h:7000 cannot be reached: ETIMEDOUT',
    );
  });

  it('says a dependency refused the connection when it answered (a SQLSTATE, a Redis error reply)', () => {
    const role = Object.assign(new Error('role "ro" is not permitted to log in'), { code: '28000' });
    expect(unreachable('Postgres', new URL('postgres://ro@db/x'), 5432, role).message).toBe(
      'Postgres at db:5432 refused the connection: role "ro" is not permitted to log in',
    );
    const wrongPass = Object.assign(new Error('WRONGPASS invalid username-password pair'), { name: 'ReplyError' });
    expect(unreachable('Redis', new URL('redis://:pw@r'), 6379, wrongPass).message).toBe(
      'Redis at r:6379 refused the connection: WRONGPASS invalid username-password pair',
    );
  });
});
