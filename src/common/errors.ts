/** Every error code of shared/API.md, plus the two the service adds for unknown routes and internal errors. */
export enum ErrorCode {
  VALIDATION_FAILED = 'VALIDATION_FAILED',
  UNAUTHENTICATED = 'UNAUTHENTICATED',
  FORBIDDEN = 'FORBIDDEN',
  POOL_NOT_FOUND = 'POOL_NOT_FOUND',
  RESOURCE_NOT_FOUND = 'RESOURCE_NOT_FOUND',
  RESERVATION_NOT_FOUND = 'RESERVATION_NOT_FOUND',
  ROUTE_NOT_FOUND = 'ROUTE_NOT_FOUND',
  POOL_EXISTS = 'POOL_EXISTS',
  POOL_EXHAUSTED = 'POOL_EXHAUSTED',
  HOLD_EXPIRED = 'HOLD_EXPIRED',
  HOLD_LOST = 'HOLD_LOST',
  RESERVATION_CLOSED = 'RESERVATION_CLOSED',
  NOT_ALLOCATED = 'NOT_ALLOCATED',
  IDEMPOTENCY_KEY_REUSED = 'IDEMPOTENCY_KEY_REUSED',
  PAYLOAD_TOO_LARGE = 'PAYLOAD_TOO_LARGE',
  NOT_IN_RESERVATION = 'NOT_IN_RESERVATION',
  OWNER_QUOTA_EXCEEDED = 'OWNER_QUOTA_EXCEEDED',
  RATE_LIMITED = 'RATE_LIMITED',
  INTERNAL_ERROR = 'INTERNAL_ERROR',
  DEPENDENCY_UNAVAILABLE = 'DEPENDENCY_UNAVAILABLE',
}

export const HTTP_STATUS: Record<ErrorCode, number> = {
  [ErrorCode.VALIDATION_FAILED]: 400,
  [ErrorCode.UNAUTHENTICATED]: 401,
  [ErrorCode.FORBIDDEN]: 403,
  [ErrorCode.POOL_NOT_FOUND]: 404,
  [ErrorCode.RESOURCE_NOT_FOUND]: 404,
  [ErrorCode.RESERVATION_NOT_FOUND]: 404,
  [ErrorCode.ROUTE_NOT_FOUND]: 404,
  [ErrorCode.POOL_EXISTS]: 409,
  [ErrorCode.POOL_EXHAUSTED]: 409,
  [ErrorCode.HOLD_EXPIRED]: 409,
  [ErrorCode.HOLD_LOST]: 409,
  [ErrorCode.RESERVATION_CLOSED]: 409,
  [ErrorCode.NOT_ALLOCATED]: 409,
  [ErrorCode.IDEMPOTENCY_KEY_REUSED]: 409,
  [ErrorCode.PAYLOAD_TOO_LARGE]: 413,
  [ErrorCode.NOT_IN_RESERVATION]: 422,
  [ErrorCode.OWNER_QUOTA_EXCEEDED]: 429,
  [ErrorCode.RATE_LIMITED]: 429,
  [ErrorCode.INTERNAL_ERROR]: 500,
  [ErrorCode.DEPENDENCY_UNAVAILABLE]: 503,
};

export interface FieldError {
  field: string;
  reason: string;
}

/** The one exception type the domain throws; the global filter turns it into the API error body. */
export class DomainError extends Error {
  constructor(
    readonly code: ErrorCode,
    message: string,
    readonly details: Record<string, unknown> = {},
  ) {
    super(message);
    this.name = 'DomainError';
  }

  get status(): number {
    return HTTP_STATUS[this.code];
  }

  static validation(fields: FieldError[], message = 'request failed validation'): DomainError {
    return new DomainError(ErrorCode.VALIDATION_FAILED, message, { fields });
  }

  /** What an instance that is shutting down answers: the caller sends it again, to another instance. */
  static shuttingDown(): DomainError {
    return new DomainError(ErrorCode.DEPENDENCY_UNAVAILABLE, 'this instance is shutting down; nothing was changed (send it again)', {
      dependency: 'instance',
    });
  }

  static rateLimited(limitPerSecond: number): DomainError {
    return new DomainError(ErrorCode.RATE_LIMITED, 'too many requests; slow down', { limitPerSecond });
  }

  static unavailable(dependency: 'postgres' | 'redis', cause?: unknown): DomainError {
    const err = new DomainError(ErrorCode.DEPENDENCY_UNAVAILABLE, `${dependency} is unavailable; nothing was changed`, {
      dependency,
    });
    if (cause !== undefined) (err as { cause?: unknown }).cause = cause;
    return err;
  }
}

export interface ErrorBody {
  error: { code: string; message: string; details: Record<string, unknown> };
}

export function errorBody(code: ErrorCode, message: string, details: Record<string, unknown> = {}): ErrorBody {
  return { error: { code, message, details } };
}
